"""Training recipes, run from the repository root: ``accelerate launch -m recipes.<name>`` or ``python -m``."""
