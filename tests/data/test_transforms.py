"""lit_softmoe.data.transforms: eval and train transforms, batch augmentation and normalization give the
values they promise."""
import numpy as np
import PIL.Image
import pytest
import torch
from torchvision.transforms import v2

from lit_softmoe.data.transforms import (
    BatchNormalize,
    batch_augment,
    eval_transform,
    image_transform,
    match_channels,
    normalize_batch,
    pixel_transform,
    train_transform,
)
from lit_softmoe.models.preprocess import Preprocess


def test_eval_transform_shapes_values_and_channels():
    array = np.arange(28 * 28, dtype=np.int64).reshape(28, 28).astype(np.uint8)
    image = PIL.Image.fromarray(array)
    gray = eval_transform(28, in_channels=1, mean=0.5, std=0.25)(image)
    assert gray.shape == (1, 28, 28) and gray.dtype == torch.float32
    assert torch.allclose(gray[0], (torch.from_numpy(array).float() / 255 - 0.5) / 0.25, atol=1e-6)
    rgb = eval_transform(28, in_channels=3, mean=(0.5, 0.5, 0.5), std=0.5)(image)
    assert rgb.shape == (3, 28, 28)
    assert torch.equal(rgb[0], rgb[1]) and torch.equal(rgb[1], rgb[2])
    assert torch.allclose(rgb[0], torch.from_numpy(array).float() / 127.5 - 1, atol=1e-6)
    # RGB → 1 channel, and a resize + center crop of a non-square image.
    color = PIL.Image.fromarray(np.zeros((40, 60, 3), np.uint8))
    assert eval_transform(32, in_channels=1)(color).shape == (1, 32, 32)
    with pytest.raises(ValueError, match="2 values for 3 channels"):
        eval_transform(28, in_channels=3, mean=(0.1, 0.2))


def test_train_transform_crops_within_padding():
    image = PIL.Image.fromarray(np.full((28, 28), 255, np.uint8))
    torch.manual_seed(0)
    transform = train_transform(28, in_channels=1, mean=0.0, std=1.0, crop_padding=4)
    outputs = torch.stack([transform(image) for _ in range(20)])
    assert outputs.shape == (20, 1, 28, 28)
    # The white square moved by up to 4 px: at least one border row or column is zero padding,
    # and the center is always white.
    assert (outputs == 0).any() and torch.all(outputs[:, :, 4:24, 4:24] == 1)
    assert train_transform(24, in_channels=3)(image).shape == (3, 24, 24)


def test_batch_augment_is_deterministic_and_shifts_and_flips():
    images = torch.randint(1, 256, (64, 1, 28, 28), dtype=torch.uint8)  # no zeros: padding is visible
    first = batch_augment(images, torch.Generator().manual_seed(7), padding=2)
    again = batch_augment(images, torch.Generator().manual_seed(7), padding=2)
    other = batch_augment(images, torch.Generator().manual_seed(8), padding=2)
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert first.shape == images.shape and first.dtype == torch.uint8

    # Replay the draws to check each sample against its definition.
    generator = torch.Generator().manual_seed(7)
    offsets = torch.randint(0, 5, (2, 64), generator=generator)
    flips = torch.rand(64, generator=generator) < 0.5
    padded = torch.nn.functional.pad(images, (2, 2, 2, 2))
    for n in range(64):
        dy, dx = offsets[:, n].tolist()
        expected = padded[n, :, dy:dy + 28, dx:dx + 28]
        assert torch.equal(first[n], torch.flip(expected, dims=[-1]) if flips[n] else expected)
    assert flips.any() and (~flips).any() and (offsets != 2).any()
    unshifted = (offsets == 2).all(0)
    assert torch.equal(first[unshifted & ~flips], images[unshifted & ~flips])
    assert torch.equal(first[unshifted & flips], torch.flip(images[unshifted & flips], dims=[-1]))

    # RGB batches and no-flip mode: with hflip off, nothing is mirrored.
    rgb = torch.randint(0, 256, (8, 3, 16, 16), dtype=torch.uint8)
    out = batch_augment(rgb, torch.Generator().manual_seed(0), padding=0, hflip=False)
    assert torch.equal(out, rgb)


def test_normalize_batch_values_and_channels():
    images = torch.tensor([0, 51, 255], dtype=torch.uint8).view(1, 1, 1, 3)
    out = normalize_batch(images, mean=0.2, std=0.5)
    assert out.dtype == torch.float32
    assert torch.allclose(out.flatten(), torch.tensor([-0.4, 0.0, 1.6]), atol=1e-6)
    rgb = normalize_batch(images, mean=(0.2, 0.0, 0.2), std=(0.5, 1.0, 0.5), in_channels=3)
    assert rgb.shape == (1, 3, 1, 3) and torch.allclose(rgb[0, 0], rgb[0, 2])
    assert torch.allclose(rgb[0, 1].flatten(), torch.tensor([0.0, 0.2, 1.0]), atol=1e-6)
    color = torch.tensor([255, 0, 0], dtype=torch.uint8).view(1, 3, 1, 1)
    assert match_channels(color, 1).item() == round(0.299 * 255)



def test_normalize_batch_is_the_hand_computation_in_float32():
    """Each value is (x × float32(1/255) − mean) / std, every step rounded to float32: checked against numpy's
    float32 arithmetic, step by step, for every uint8 value and per-channel mean and std."""
    mean, std = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
    values = np.arange(256, dtype=np.uint8)
    images = torch.from_numpy(np.stack([values, values[::-1], values]).reshape(1, 3, 16, 16).copy())
    out = normalize_batch(images, mean, std)
    assert out.dtype == torch.float32 and out.shape == (1, 3, 16, 16) and out.is_contiguous()
    for channel in range(3):
        x = images[0, channel].numpy().astype(np.float32)
        scaled = x * np.float32(1 / 255)
        expected = (scaled - np.float32(mean[channel])) / np.float32(std[channel])
        assert np.array_equal(out[0, channel].numpy(), expected), channel
    # 51 / 255 = 0.2: the one value a hand checks in decimal.
    assert abs(normalize_batch(torch.full((1, 1, 1, 1), 51, dtype=torch.uint8), 0.2, 0.5).item()) < 1e-7


def test_normalize_batch_is_bitwise_the_transforms_last_two_steps_in_any_memory_format():
    """What pretraining, embed and the benchmarks normalize with: bitwise the eval transform's ToDtype and
    Normalize image by image (what eval and LiT on the fly feed the tower), on a channels-last batch (a
    streamed one) as on a contiguous one, with mean and std given as values or as (C, 1, 1) tensors."""
    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (4, 3, 20, 20), dtype=torch.uint8, generator=generator)
    preprocess = Preprocess(20, 3, mean=(0.3, 0.4, 0.5), std=(0.2, 0.25, 0.3))
    transform = image_transform(preprocess)
    pixels, normalize = pixel_transform(preprocess), BatchNormalize(preprocess)
    expected = torch.stack([transform(image) for image in images])
    assert torch.equal(pixels(images[0]), images[0])  # the uint8 half keeps the pixels
    channels_last = images.contiguous(memory_format=torch.channels_last)
    as_tensors = (torch.tensor([0.3, 0.4, 0.5])[:, None, None], torch.tensor([0.2, 0.25, 0.3])[:, None, None])
    for got in (normalize(images), normalize(channels_last), normalize_batch(channels_last, *as_tensors)):
        assert torch.equal(got, expected) and got.is_contiguous()
    assert torch.equal(channels_last, images)  # the input is left as it was
    with pytest.raises(ValueError, match="uint8"):
        normalize_batch(images.float())


def test_normalize_batch_broadcasts_a_gray_batch_to_three_channels():
    """A gray split and an RGB tower: one channel, three means and stds, as pretraining normalizes them."""
    gray = torch.tensor([0, 51, 255], dtype=torch.uint8).view(1, 1, 1, 3)
    out = normalize_batch(gray, mean=(0.2, 0.0, 0.2), std=(0.5, 1.0, 0.5))
    assert out.shape == (1, 3, 1, 3)
    assert torch.equal(out, normalize_batch(gray.expand(-1, 3, -1, -1), (0.2, 0.0, 0.2), (0.5, 1.0, 0.5)))
    assert torch.allclose(out[0, 1].flatten(), torch.tensor([0.0, 0.2, 1.0]), atol=1e-6)


def test_palette_and_alpha_images_become_rgb_not_indices():
    palette = PIL.Image.new("P", (4, 4), 1)
    palette.putpalette([0, 0, 0, 200, 100, 50] + [0] * 762)  # index 1 → (200, 100, 50)
    rgba = PIL.Image.new("RGBA", (4, 4), (10, 20, 30, 0))
    to_bytes = eval_transform(4, in_channels=3, mean=0.0, std=1 / 255)  # output = pixel value
    assert to_bytes(palette)[:, 0, 0].round().tolist() == [200, 100, 50]
    # Transparent pixels on white, as `lit-softmoe data` wrote the training shards (not the color under them).
    assert to_bytes(rgba)[:, 0, 0].round().tolist() == [255, 255, 255]
    gray = eval_transform(4, in_channels=1, mean=0.0, std=1 / 255)(palette)
    assert gray.shape == (1, 4, 4) and round(gray[0, 0, 0].item()) == round(0.299 * 200 + 0.587 * 100 + 0.114 * 50)


def test_grayscale_copied_to_rgb_after_resizing_equals_before():
    image = PIL.Image.fromarray(np.random.default_rng(1).integers(0, 256, (28, 28), dtype=np.uint8))
    ours = eval_transform(40, in_channels=3)(image)
    reference = v2.Compose([v2.ToImage(), v2.RGB(), v2.Resize(40, antialias=True), v2.CenterCrop(40),
                            v2.ToDtype(torch.float32, scale=True), v2.Normalize([0.5] * 3, [0.5] * 3)])(image)
    assert torch.equal(ours, reference)
    torch.manual_seed(0)
    augmented = train_transform(24, in_channels=3, scale=(0.5, 1.0))(image)
    assert augmented.shape == (3, 24, 24) and torch.equal(augmented[0], augmented[1])


def test_random_resized_crop_is_torchvisions_resized_crop_of_a_box_drawn_as_torchvision_draws():
    """train_transform's random-resized crop draws its box itself (one torch.rand a sample instead of
    torchvision's dozen tiny tensors), crops and flips the PIL image, then resizes the tensor: the
    pixels are torchvision's resized_crop kernel's for that box on the whole image, and the boxes
    follow torchvision's RandomResizedCrop.get_params distribution.

    Unflipped, the same kernel runs on the same pixels: equal to the bit. Flipped, ours resizes the mirrored crop
    and the reference mirrors the resized one: equal in exact arithmetic, but the resize's float sums run in
    mirrored order, and a value within rounding of .5 can round to the other uint8 level (seen on 2-3 pixels of
    2 boxes in 100 under ATEN_CPU_CAPABILITY=default, none under avx2): at most 1 level apart there."""
    from torchvision.transforms import RandomResizedCrop
    from torchvision.transforms.v2 import functional as TF

    from lit_softmoe.data.fashion_mnist import read_fashion_mnist
    from lit_softmoe.data.transforms import _RandomAreaCropFlip

    images, _ = read_fashion_mnist("test", allow_download=False)
    photo = PIL.Image.fromarray(np.stack([images[0], images[1], images[2]], axis=-1)).resize((90, 70))  # RGB, 90×70
    transform = train_transform(32, in_channels=3, scale=(0.08, 1.0), normalize=False)
    whole = TF.pil_to_tensor(photo)
    step = _RandomAreaCropFlip((0.08, 1.0), hflip=True)
    flips = 0
    for seed in range(100):
        torch.manual_seed(seed)
        top, left, height, width, flip = step.draw(70, 90)
        torch.manual_seed(seed)
        ours = transform(photo)
        expected = TF.resized_crop(whole, top, left, height, width, [32, 32], antialias=True)
        if flip:
            assert (ours.int() - expected.flip(-1).int()).abs().max() <= 1, seed
        else:
            assert torch.equal(ours, expected), seed
        flips += flip
    assert 30 <= flips <= 70
    # A tensor input is cropped and flipped alike.
    torch.manual_seed(3)
    from_pil = transform(photo)
    torch.manual_seed(3)
    assert torch.equal(transform(whole), from_pil)

    # The boxes: torchvision's distribution (area fraction, aspect ratio, position), on a wide image too
    # (where many tries fail and the center-crop fallback is reached).
    def boxes(draw, count=3000):
        torch.manual_seed(0)
        return np.array([draw() for _ in range(count)], dtype=float)  # (count, 4): top, left, h, w

    for height, width, scale in ((70, 90, (0.08, 1.0)), (20, 200, (0.5, 1.0))):
        mine = boxes(lambda: _RandomAreaCropFlip(scale, hflip=False).draw(height, width)[:4])
        theirs = boxes(lambda: RandomResizedCrop.get_params(torch.zeros(1, height, width), list(scale), [3 / 4, 4 / 3]))
        for boxes_ in (mine, theirs):
            assert (boxes_[:, 0] + boxes_[:, 2] <= height).all() and (boxes_[:, 1] + boxes_[:, 3] <= width).all()
        area_mine = mine[:, 2] * mine[:, 3] / (height * width)
        area_theirs = theirs[:, 2] * theirs[:, 3] / (height * width)
        aspect_mine, aspect_theirs = mine[:, 3] / mine[:, 2], theirs[:, 3] / theirs[:, 2]
        assert abs(area_mine.mean() - area_theirs.mean()) < 0.02, (area_mine.mean(), area_theirs.mean())
        assert abs(np.log(aspect_mine).mean() - np.log(aspect_theirs).mean()) < 0.03
        # Log-uniform: as many below 1 as above.
        assert abs((aspect_mine < 1).mean() - (aspect_theirs < 1).mean()) < 0.03
        assert abs((mine[:, 0] / height).mean() - (theirs[:, 0] / height).mean()) < 0.02
        assert abs((mine[:, 1] / width).mean() - (theirs[:, 1] / width).mean()) < 0.02
        assert abs(area_mine.min() - area_theirs.min()) < 0.02 and abs(area_mine.max() - area_theirs.max()) < 0.02
