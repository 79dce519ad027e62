"""Train FPSA-ViT for image classification: a tiny ViT from scratch, or fine-tune a local ViT checkpoint.

    python -m recipes.fpsa_vit --output_dir runs/fpsa_vit_digits                  # offline defaults (see below)
    accelerate launch recipes/fpsa_vit.py --fp_max_iter 8 --bf16
    accelerate launch recipes/fpsa_vit.py --model_name_or_path path/to/vit_checkpoint --image_size 224

Default data: scikit-learn's ``load_digits`` (1797 grey 8x8 images of the digits 0-9, shipped inside every
scikit-learn wheel, so nothing is downloaded), split 80/20 stratified with a fixed seed. The images are fed as
``pixel_values`` tensors, upsampled bilinearly to ``--image_size`` and repeated over the model's channels. The export
holds a ``ViTImageProcessor`` doing the same to 8-bit images (``image_processor``), so
``pipeline("image-classification", model=output_dir, trust_remote_code=True)`` classifies digit images and names the
digits. The default model is a tiny FPSA-ViT built from scratch (8x8 RGB images -- the grey digit on every channel,
as the image pipelines hand every image over as RGB --, 2x2 patches, 2 layers of width 64) with FPSA-ViT's own solver
settings (``fp_max_iter=16``, ``fp_tol=1e-3``, the masked implicit gradient), tokens halting on the change of their
iterate (``--fpsa_halt_unit state``: median 5 / p90 6 against 6 / 8 per head at tol 1e-4, the same accuracy) and
the Jacobian penalty ``--fpsa_jac_weight 30``: without it the iterations of a from-scratch model stop converging
during training and the masked implicit gradient then trains poorly (docs/fpsa_recipes.md has the measurements). With
``--model_name_or_path`` a ViT (or FPSA-ViT) checkpoint is loaded instead, its classifier resized to 10 classes.
The log lines carry the median / p90 FPSA iterations and the cap-hit rate; ``--resume_from_checkpoint latest``
continues an interrupted run; the export loads with ``AutoModelForImageClassification.from_pretrained(dir,
trust_remote_code=True)``.
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from transformers import HfArgumentParser, ViTImageProcessor
from transformers.image_utils import PILImageResampling

from hf_fixedpoint import fpsa_training
from hf_fixedpoint.core.fp_fpsa_stats import FPSAStats
from hf_fixedpoint.modeling.fpsa_vit import FPSAViTConfig, FPSAViTForImageClassification
from hf_fixedpoint.recipe_args import progress_bar


@dataclass
class ViTArgs(fpsa_training.TrainingArgs):
    model_name_or_path: str = field(default=None, metadata={"help": "ViT checkpoint to fine-tune (default: a tiny "
                                                                     "FPSA-ViT from scratch)"})
    image_size: int = field(default=8, metadata={"help": "side of the (upsampled) input images"})
    patch_size: int = field(default=2, metadata={"help": "patch side of the from-scratch model"})
    hidden_size: int = field(default=64, metadata={"help": "width of the from-scratch model"})
    num_hidden_layers: int = field(default=2, metadata={"help": "layers of the from-scratch model"})
    num_attention_heads: int = field(default=4, metadata={"help": "heads of the from-scratch model"})
    test_fraction: float = field(default=0.2, metadata={"help": "held-out share of the digits"})
    learning_rate: float = field(default=2e-3, metadata={"help": "AdamW peak learning rate"})
    num_train_epochs: float = field(default=15.0, metadata={"help": "passes over the training set"})
    per_device_train_batch_size: int = field(default=64, metadata={"help": "images per step and process"})
    per_device_eval_batch_size: int = field(default=128, metadata={"help": "images per evaluation batch"})
    fpsa_jac_weight: float = field(default=30.0, metadata={"help": "weight of the FPSA Jacobian penalty, which "
                                                                   "trains the map to contract (see the docs)"})
    fpsa_halt_unit: str = field(default="state", metadata={"help": "what halts as one entry: state (each token on the "
                                                                   "change of its iterate; fewer iterations here, "
                                                                   "docs/fpsa.md) | head | token"})


def load_digits_split(test_fraction, seed):
    """sklearn digits as (N, 1, 8, 8) floats in [0, 1] and labels, split stratified into train / test."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    images, labels = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(images, labels, test_size=test_fraction, stratify=labels,
                                                        random_state=seed)

    def as_tensors(x, y):
        return torch.tensor(x, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0, torch.tensor(y, dtype=torch.long)

    return as_tensors(x_train, y_train), as_tensors(x_test, y_test)


def image_collate(image_size, num_channels):
    """Batch (image, label) pairs into ``pixel_values`` (resized, channels repeated, normalised to [-1, 1])."""

    def collate(items):
        pixels = torch.stack([x for x, _ in items])
        if pixels.shape[-1] != image_size:
            pixels = F.interpolate(pixels, size=(image_size, image_size), mode="bilinear", align_corners=False)
        return {"pixel_values": pixels.repeat(1, num_channels, 1, 1) * 2 - 1,
                "labels": torch.stack([y for _, y in items])}

    return collate


def image_processor(config):
    """The ``ViTImageProcessor`` that does to an 8-bit image (values 0..255, grey or RGB) what ``image_collate`` does
    to a digit in [0, 1]: bilinear resize to the model's size, grey repeated over three channels for an RGB model,
    then ``x / 255 * 2 - 1``. Exported with the model for ``pipeline("image-classification")``; the 17 grey levels of
    the digits (0..16) become 8-bit pixels ``round(16 * v)`` -> at most 1/510 from what the evaluation sees."""
    channels = config.num_channels
    return ViTImageProcessor(do_resize=True, size={"height": config.image_size, "width": config.image_size},
                             resample=PILImageResampling.BILINEAR, do_rescale=True, rescale_factor=1 / 255,
                             do_normalize=True, image_mean=[0.5] * channels, image_std=[0.5] * channels,
                             do_convert_rgb=channels == 3)


def build_model(args):
    """A tiny FPSA-ViT from scratch, or the given checkpoint with a fresh 10-class classifier; the classes are named
    after their digits. RGB input (the grey digit on every channel), because the image pipelines hand every image to
    the processor as RGB."""
    labels = {"id2label": {i: str(i) for i in range(10)}, "label2id": {str(i): i for i in range(10)}}
    if args.model_name_or_path:
        return FPSAViTForImageClassification.from_pretrained(
            args.model_name_or_path, num_labels=10, ignore_mismatched_sizes=True, **labels,
            **fpsa_training.fp_overrides(args))
    config = FPSAViTConfig(image_size=args.image_size, patch_size=args.patch_size, num_channels=3,
                           hidden_size=args.hidden_size, num_hidden_layers=args.num_hidden_layers,
                           num_attention_heads=args.num_attention_heads, intermediate_size=2 * args.hidden_size,
                           num_labels=10, **labels, **fpsa_training.fp_overrides(args))
    return FPSAViTForImageClassification(config)


@torch.no_grad()
def evaluate_vit(model, loader, accelerator):
    model.eval()
    correct, total, stats = 0, 0, []
    for batch in progress_bar(loader, "eval", leave=False):
        outputs = model(**batch)
        pred, ref = accelerator.gather_for_metrics((outputs.logits.argmax(-1), batch["labels"]))
        correct += (pred == ref).sum().item()
        total += ref.numel()
        stats.append(outputs.fp_stats)
    model.train()
    return {"accuracy": correct / total, **fpsa_training.iteration_summary(FPSAStats.merge(stats))}


def main():
    (args,) = HfArgumentParser(ViTArgs).parse_args_into_dataclasses()
    accelerator = fpsa_training.make_accelerator(args)

    # Model first: a checkpoint fixes the image size and channels the data must have.
    model = build_model(args)
    size, channels = model.config.image_size, model.config.num_channels
    (x_train, y_train), (x_test, y_test) = load_digits_split(args.test_fraction, args.seed)
    collate = image_collate(size, channels)
    train_loader = DataLoader(list(zip(x_train, y_train)), batch_size=args.per_device_train_batch_size, shuffle=True,
                              collate_fn=collate)
    test_loader = accelerator.prepare(DataLoader(list(zip(x_test, y_test)), batch_size=args.per_device_eval_batch_size,
                                                 collate_fn=collate))
    accelerator.print(f"data: sklearn digits, {len(x_train)} train / {len(x_test)} test images at {size}x{size}; "
                      f"model: {sum(p.numel() for p in model.parameters())} parameters")

    model, history = fpsa_training.train(args, accelerator, model, train_loader)
    fpsa_training.finish(args, accelerator, model, evaluate_vit(model, test_loader, accelerator), history,
                         image_processor(model.config))


if __name__ == "__main__":
    main()
