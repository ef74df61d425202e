"""Image preprocessing: per-image torchvision v2 pipelines, and batch versions on in-memory tensors.

A tower's own preprocessing (`models.preprocess.Preprocess`) gives two halves: `pixel_transform`
(image → uint8 pixels, in loader workers) and `BatchNormalize` (uint8 batch → float32 input, where
the tower runs); `image_transform` is the two image by image, for code that takes one image at a
time.

Per-image (`eval_transform`, `train_transform`): for streamed shards, as open_clip's
`image_transform` (resize + center crop to eval; random-resized crop to train), plus the channel
conversion a tower needs (grayscale ↔ RGB; palette and alpha images are converted in PIL first)
and, for tiny 28×28 sets, the CIFAR-style "pad and random crop" instead of a random-resized crop.

Per-batch (`batch_augment`, `normalize_batch`): pretraining keeps a small set such as
Fashion-MNIST in memory as uint8 (N, C, H, W) and augments a whole batch with one gather, drawing
its randomness from a torch.Generator so a run is repeatable (per-image transforms in Python would
cost more than a tiny model's step). `normalize_batch` is the one normalization of uint8 batches,
bitwise the per-image transforms' own last two steps.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Sequence

import PIL.Image
import torch
import torch.nn.functional as F
from torchvision.transforms import v2

from lit_softmoe.data.images import decode, jpeg_min_side, upright_l_or_rgb

if TYPE_CHECKING:  # the description is plain data; importing the models package costs seconds
    from lit_softmoe.models.preprocess import Preprocess

# ITU-R 601-2 luma, the weights PIL's convert("L") and torchvision's Grayscale use.
_LUMA_WEIGHTS = (0.299, 0.587, 0.114)


def _per_channel(values: float | Sequence[float], in_channels: int, name: str) -> list[float]:
    """Broadcast one value (or a 1-tuple) to `in_channels`; otherwise the length must match."""
    values = [float(values)] if isinstance(values, (int, float)) else [float(v) for v in values]
    if len(values) == 1:
        values = values * in_channels
    if len(values) != in_channels:
        raise ValueError(f"{name} has {len(values)} values for {in_channels} channels")
    return values


def to_l_or_rgb(image: PIL.Image.Image) -> PIL.Image.Image:
    """A PIL image upright and in mode "L" or "RGB", as the shards were written.

    `v2.ToImage` copies a PIL image's raw bands, so a palette ("P") image would become a map of
    palette indices and an "RGBA" one four channels. The conversion is `writers.normalize_image`'s
    (`images.upright_l_or_rgb`): EXIF orientation applied, alpha composited on white (open_clip
    drops it, exposing whatever color hides under transparent pixels, often black), 16-bit gray
    scaled to 8 bits — so eval and a loaded model's `preprocess` see raw images as training did.
    """
    return upright_l_or_rgb(image)


def _channel_conversion(in_channels: int) -> tuple[list[v2.Transform], list[v2.Transform]]:
    """(before geometry, after geometry) channel steps for a tower taking `in_channels`.

    Reducing RGB → luma runs before the resize (one channel to resize instead of three);
    expanding grayscale → RGB runs after it (the channels are copies, and resizing commutes with
    copying, so the result is the same for a third of the work).
    """
    if in_channels == 3:
        return [], [v2.RGB()]  # 1 channel → 3 equal channels; 3 stay 3
    if in_channels == 1:
        # tensors only: PIL images arrive as "L" already
        return [v2.Grayscale(num_output_channels=1)], []
    raise ValueError(f"in_channels must be 1 or 3, got {in_channels}")


def to_l(image: PIL.Image.Image) -> PIL.Image.Image:
    """A PIL image in mode "L", converted by PIL itself.

    PIL's luma is exact on gray content (its fixed-point weights sum to exactly 1), so a grayscale
    photo saved as RGB gives the same pixels as the original; torchvision's tensor Grayscale
    truncates and would shift such an image down one level (CLIP_benchmark decodes every image to
    RGB, so our gray towers would otherwise see other pixels there than here).
    """
    return to_l_or_rgb(image).convert("L")


class _Decode:
    """A transform's first step on PIL inputs: `images.decode` (a lazily opened JPEG is decoded at
    the reduced scale `min_side` allows, as the pipeline and the eval readers decode it), then L or
    RGB."""

    def __init__(self, in_channels: int, min_side: int | None):
        self.in_channels, self.min_side = in_channels, min_side

    def __call__(self, image: PIL.Image.Image) -> PIL.Image.Image:
        image = decode(image, self.min_side)
        return to_l(image) if self.in_channels == 1 else image

    def __repr__(self) -> str:
        return f"_Decode(in_channels={self.in_channels}, min_side={self.min_side})"


class _Step(v2.Lambda):
    """A v2 step running one of this module's callables on the input types given; printed with the
    callable (v2.Lambda prints only the types)."""

    def extra_repr(self) -> str:
        return repr(self.lambd)


def _pil_modes(in_channels: int, min_side: int | None) -> v2.Transform:
    return _Step(_Decode(in_channels, min_side), PIL.Image.Image)  # applied to PIL inputs only


def decode_min_side(transform: Any) -> int | None:
    """The shorter side JPEGs keep when decoded for `transform` (None: full decode, or not ours).

    Readers that open files themselves (the shard pipeline, the eval readers) decode with this, so
    the transform's own first step finds the image already decoded as it would have decoded it.
    """
    steps = getattr(transform, "transforms", None)
    first = steps[0] if isinstance(transform, v2.Compose) and steps else None
    step = getattr(first, "lambd", None)
    return step.min_side if isinstance(step, _Decode) else None


class _RandomAreaCropFlip:
    """The random half of RandomResizedCrop (Szegedy et al., 2015: an area fraction in `scale`, an
    aspect ratio in 3/4-4/3 drawn log-uniformly, up to 10 tries, else the center crop —
    torchvision's `RandomResizedCrop.get_params` algorithm), cropped from the image as it is, then a
    horizontal flip with probability 0.5; the resize to the tower's size follows on the tensor.

    Why not torchvision's own steps: its `get_params` makes a dozen one-element tensors per image
    (costing about as much as the resize), so the draws here come from one `torch.rand` on torch's
    default generator (which the pipeline seeds per sample); and cropping and flipping the PIL image
    copies the crop alone, and a smaller tensor is made from it. `scripts/bench_pretrain_data.py`
    measures the loader against timm's. Tensors (C, H, W) are cropped and flipped alike.
    """

    ratio = (3 / 4, 4 / 3)

    def __init__(self, scale: tuple[float, float], hflip: bool):
        self.scale, self.hflip = tuple(scale), hflip

    def draw(self, height: int, width: int) -> tuple[int, int, int, int, bool]:
        """(top, left, crop height, crop width, flip) for an image of `height` × `width`."""
        uniform = torch.rand(23).tolist()  # 10 tries × (area, ratio), then top, left, flip
        log_low, log_high = math.log(self.ratio[0]), math.log(self.ratio[1])
        area = height * width
        flip = self.hflip and uniform[22] < 0.5
        for attempt in range(10):
            target = area * (self.scale[0] + (self.scale[1] - self.scale[0]) * uniform[2 * attempt])
            aspect = math.exp(log_low + (log_high - log_low) * uniform[2 * attempt + 1])
            crop_width, crop_height = (round(math.sqrt(target * aspect)),
                                       round(math.sqrt(target / aspect)))
            if 0 < crop_width <= width and 0 < crop_height <= height:
                top = int(uniform[20] * (height - crop_height + 1))
                left = int(uniform[21] * (width - crop_width + 1))
                return top, left, crop_height, crop_width, flip
        # No try fitted: the largest center crop within the ratio range, as torchvision falls back.
        crop_width, crop_height = width, height
        if width / height < self.ratio[0]:
            crop_height = round(width / self.ratio[0])
        elif width / height > self.ratio[1]:
            crop_width = round(height * self.ratio[1])
        return (height - crop_height) // 2, (width - crop_width) // 2, crop_height, crop_width, flip

    def __call__(self, image: PIL.Image.Image | torch.Tensor) -> PIL.Image.Image | torch.Tensor:
        if isinstance(image, PIL.Image.Image):
            top, left, height, width, flip = self.draw(image.height, image.width)
            image = image.crop((left, top, left + width, top + height))
            return image.transpose(PIL.Image.Transpose.FLIP_LEFT_RIGHT) if flip else image
        top, left, height, width, flip = self.draw(*image.shape[-2:])
        image = image[..., top:top + height, left:left + width]
        return image.flip(-1) if flip else image

    def __repr__(self) -> str:
        return f"_RandomAreaCropFlip(scale={self.scale}, ratio=(3/4, 4/3), hflip={self.hflip})"


def _to_normalized_float(in_channels: int, mean, std) -> list[v2.Transform]:
    return [
        v2.ToDtype(torch.float32, scale=True),  # uint8 [0, 255] → [0, 1]
        v2.Normalize(_per_channel(mean, in_channels, "mean"),
                     _per_channel(std, in_channels, "std")),
    ]


def eval_transform(image_size: int, in_channels: int = 3, mean: float | Sequence[float] = 0.5,
                   std: float | Sequence[float] = 0.5, decode: str = "full",
                   normalize: bool = True) -> v2.Compose:
    """PIL image or uint8 (C, H, W) tensor → normalized float32 (in_channels, image_size,
    image_size).

    Resizes the shorter side to `image_size`, then takes the center square. `decode="reduced"`
    decodes JPEGs at a DCT scale keeping the shorter side ≥ `images.REDUCED_DECODE_FACTOR` ×
    `image_size` (in the pipeline, the eval readers, and here for a PIL image opened but not yet
    loaded). `normalize=False` stops at uint8 (a quarter of the bytes between processes;
    `normalize_batch` then runs on the batch, on the device).
    """
    before, after = _channel_conversion(in_channels)
    return v2.Compose([
        _pil_modes(in_channels, jpeg_min_side(decode, image_size)),
        v2.ToImage(),
        *before,
        v2.Resize(image_size, antialias=True),
        v2.CenterCrop(image_size),
        *after,
        *(_to_normalized_float(in_channels, mean, std) if normalize else []),
    ])


def pixel_transform(preprocess: Preprocess) -> v2.Compose:
    """Image → uint8 (C, H, W) pixels, as `preprocess` prepares them for its tower (before the
    normalization): the steps loader workers run, sending a quarter of float32's bytes through
    shared memory, pinning and the copy to the GPU; `BatchNormalize` then runs where the tower
    runs."""
    return eval_transform(preprocess.image_size, preprocess.channels, decode=preprocess.decode,
                          normalize=False)


def image_transform(preprocess: Preprocess) -> v2.Compose:
    """Image → normalized float32 (C, H, W): `pixel_transform`'s steps, then the normalization,
    image by image (bitwise `BatchNormalize` of the pixels). For readers that hand images one at a
    time to code that is not ours: a loaded model's `preprocess`, the eval suite's loaders."""
    return eval_transform(preprocess.image_size, preprocess.channels, preprocess.mean,
                          preprocess.std, decode=preprocess.decode)


class BatchNormalize:
    """uint8 (N, C, H, W) batch → the tower's float32 input, on the batch's device:
    `normalize_batch` with the preprocessing's mean and std, which are copied to each device once,
    not per batch."""

    def __init__(self, preprocess: Preprocess):
        self.mean, self.std = preprocess.mean, preprocess.std
        self._on_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        if images.device not in self._on_device:
            self._on_device[images.device] = (_channel_values(self.mean, images.device),
                                              _channel_values(self.std, images.device))
        mean, std = self._on_device[images.device]
        return normalize_batch(images, mean, std)

    def __repr__(self) -> str:
        return f"BatchNormalize(mean={self.mean}, std={self.std})"


def train_transform(
    image_size: int,
    in_channels: int = 3,
    mean: float | Sequence[float] = 0.5,
    std: float | Sequence[float] = 0.5,
    crop_padding: int | None = None,
    random_resized_crop: bool = True,
    scale: tuple[float, float] = (0.35, 1.0),
    hflip: bool = True,
    decode: str = "full",
    randaugment: Sequence[int] = (),
    normalize: bool = True,
) -> v2.Compose:
    """Training counterpart of `eval_transform`.

    Args:
        crop_padding: if set, resize + center crop, then pad by this many pixels and crop a random
            `image_size` square — the cheap augmentation for tiny images (28×28, 32×32).
            Takes precedence over `random_resized_crop`.
        random_resized_crop: otherwise, crop a random area fraction in `scale` and resize it.
        hflip: flip horizontally with probability 0.5.
        decode: "reduced" decodes JPEGs at a reduced scale relative to the smallest random crop,
            not to the image: that crop (side ≥ √(scale[0] · 3/4) of the shorter one) is upscaled to
            `image_size`, so it must keep `REDUCED_DECODE_FACTOR` × `image_size` pixels itself.
        randaugment: (num_ops, magnitude) of torchvision's RandAugment (Cubuk et al., 2020) after
            the crop and flip, on uint8 pixels (the ViT/V-MoE ImageNet-21k recipes use (2, 15)); ()
            for none.
        normalize: False stops at uint8 (see `eval_transform`).
    """
    side = image_size
    if crop_padding is None and random_resized_crop:
        # RandomResizedCrop's ratio ≥ 3/4
        side = math.ceil(image_size / math.sqrt(scale[0] * 3 / 4))
    crop_flip = []  # before the tensor: on the PIL image
    flip = [v2.RandomHorizontalFlip()] if hflip else []
    if crop_padding is not None:
        geometry = [v2.Resize(image_size, antialias=True), v2.CenterCrop(image_size),
                    v2.RandomCrop(image_size, padding=crop_padding), *flip]
    elif random_resized_crop:
        crop_flip = [_Step(_RandomAreaCropFlip(scale, hflip), PIL.Image.Image, torch.Tensor)]
        geometry = [v2.Resize([image_size, image_size], antialias=True)]
    else:
        geometry = [v2.Resize(image_size, antialias=True), v2.CenterCrop(image_size), *flip]
    if randaugment and len(randaugment) != 2:
        raise ValueError(f"randaugment takes (num_ops, magnitude), got {list(randaugment)}")
    augment = ([v2.RandAugment(num_ops=int(randaugment[0]), magnitude=int(randaugment[1]))]
               if randaugment else [])
    before, after = _channel_conversion(in_channels)
    return v2.Compose([
        _pil_modes(in_channels, jpeg_min_side(decode, side)),
        *crop_flip,
        v2.ToImage(),
        *before,
        *geometry,
        *after,
        *augment,
        *(_to_normalized_float(in_channels, mean, std) if normalize else []),
    ])


def batch_augment(images: torch.Tensor, generator: torch.Generator, padding: int = 2,
                  hflip: bool = True) -> torch.Tensor:
    """Random crop with zero padding + horizontal flip, for a whole uint8 batch at once.

    Args:
        images: (N, C, H, W) uint8 (any dtype works), on any device.
        generator: a CPU torch.Generator; the same seed gives the same crops and flips.
        padding: each image moves by up to this many pixels in each direction.
        hflip: flip each image with probability 0.5.

    Returns:
        (N, C, H, W), same dtype and device. Sample n is `padded[n, :, dy:dy+H, dx:dx+W]`,
        mirrored left-right when its flip is drawn, with dy, dx uniform in [0, 2 * padding].
    """
    n, channels, height, width = images.shape
    device = images.device
    offsets = torch.randint(0, 2 * padding + 1, (2, n), generator=generator).to(device)  # (dy, dx)
    flips = torch.rand(n, generator=generator).to(device) < 0.5
    padded = F.pad(images, (padding, padding, padding, padding))  # (N, C, H+2p, W+2p), zeros
    rows = offsets[0, :, None] + torch.arange(height, device=device)  # (N, H)
    columns = torch.arange(width, device=device).expand(n, width)  # (N, W)
    if hflip:
        columns = torch.where(flips[:, None], columns.flip(1), columns)
    columns = offsets[1, :, None] + columns
    # One gather over the flattened padded image, not advanced indexing (slower on the CPU).
    source = rows[:, :, None] * (width + 2 * padding) + columns[:, None, :]  # (N, H, W)
    source = source.view(n, 1, height * width).expand(n, channels, height * width)
    return padded.reshape(n, channels, -1).gather(2, source).view(n, channels, height, width)


def match_channels(images: torch.Tensor, in_channels: int) -> torch.Tensor:
    """(N, C, H, W) → (N, in_channels, H, W): grayscale repeated to RGB, or RGB reduced to luma."""
    channels = images.shape[1]
    if channels == in_channels:
        return images
    if channels == 1 and in_channels == 3:
        return images.expand(-1, 3, -1, -1)  # a view: normalize_batch makes the copy
    if channels == 3 and in_channels == 1:
        weights = torch.tensor(_LUMA_WEIGHTS, device=images.device).view(1, 3, 1, 1)
        luma = (images.float() * weights).sum(1, keepdim=True)
        return luma.round().to(images.dtype) if not images.is_floating_point() else luma
    raise ValueError(f"cannot turn {channels} channels into {in_channels}")


def normalize_batch(images: torch.Tensor, mean: float | Sequence[float] | torch.Tensor = 0.5,
                    std: float | Sequence[float] | torch.Tensor = 0.5,
                    in_channels: int | None = None) -> torch.Tensor:
    """uint8 (N, C, H, W) → float32 (N, C', H, W), contiguous: (x × (1/255) − mean) / std per
    channel, on the batch's device.

    Bitwise what a transform's last two steps (`v2.ToDtype(float32, scale=True)`, `v2.Normalize`)
    give image by image: the same float32 operations in the same order, each exactly rounded on the
    CPU and the GPU alike. So pretraining normalizes its batches as the saved tower's `preprocess`
    does at evaluation, and embed's batches hold the pixels eval and LiT on the fly feed the tower.
    (`x / 255` is not the same: on the CPU a true division rounds otherwise than the multiplication
    by 1/255 in float32.)

    Args:
        images: uint8 (N, C, H, W), in any memory format: a streamed batch is channels-last
            (`shard_stream.ShardStream._collate`), an in-memory one is not; the cast lays both out
            contiguously, where the per-channel broadcast is fast and the tower's input is alike.
        mean, std: one value, or one per channel (a 1-channel batch with three broadcasts to three
            channels); a float32 tensor of them already on the batch's device ((C,) or (C, 1, 1)) is
            used as is, with no copy to the device per batch.
        in_channels: if given, the channels are converted first (`match_channels`), as the per-image
            transforms do.
    """
    if images.dtype != torch.uint8:
        raise ValueError(f"normalize_batch takes uint8 pixels, got {images.dtype}")
    if in_channels is not None:
        images = match_channels(images, in_channels)
    mean, std = _channel_values(mean, images.device), _channel_values(std, images.device)
    # In place on the cast copy but for a mean that broadcasts the channels (a gray batch, an RGB
    # tower).
    # v2.ToDtype's
    pixels = images.to(torch.float32, memory_format=torch.contiguous_format).mul_(1.0 / 255)
    # v2.Normalize's
    pixels = pixels.sub_(mean) if len(mean) in (1, pixels.shape[1]) else pixels.sub(mean)
    return pixels.div_(std)


def _channel_values(values: float | Sequence[float] | torch.Tensor,
                    device: torch.device) -> torch.Tensor:
    """float32 (C, 1, 1) on `device` (as v2.Normalize holds its mean and std); a tensor already
    there is a view."""
    return torch.as_tensor(values, dtype=torch.float32, device=device).reshape(-1, 1, 1)
