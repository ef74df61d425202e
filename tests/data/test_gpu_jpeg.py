"""lit_softmoe.data.gpu_jpeg: which images go to the GPU decoder, how a batch travels from the workers, and
the decode + resize + crop after it. `JpegBatchDecoder` runs here on the CPU device (torchvision's decode_jpeg
takes the same list there), so everything but nvJPEG itself is tested; tests/test_cuda.py runs it on a GPU."""
from __future__ import annotations

import io

import numpy as np
import PIL.Image
import pytest
import torch

from evalkit import FOOLBOX_DATA, needs_foolbox
from lit_softmoe.data.gpu_jpeg import DeferToGpu, EncodedJpeg, JpegBatchDecoder, gpu_decodable, pack
from lit_softmoe.data.transforms import eval_transform

pytestmark = needs_foolbox


def _photos(count: int = 4) -> list[PIL.Image.Image]:
    """foolbox's ImageNet photos (real content), cropped to differing sizes and aspect ratios."""
    sizes = [(512, 384), (300, 512), (450, 450), (512, 200)]
    return [PIL.Image.open(path).convert("RGB").crop((0, 0, *sizes[i % 4]))
            for i, path in enumerate(sorted(FOOLBOX_DATA.glob("imagenet_*.jpg"))[:count])]


def _jpeg(image: PIL.Image.Image, **settings) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=90, **settings)
    return buffer.getvalue()


def test_baseline_jpegs_go_to_the_gpu_and_the_rest_stay_on_the_host():
    photo = _photos(1)[0]
    exif = PIL.Image.Exif()
    exif[0x0112] = 6  # rotate 90°: the host path applies it, nvJPEG would not
    upright = PIL.Image.Exif()
    upright[0x0112] = 1
    png = io.BytesIO()
    photo.save(png, "PNG")
    assert gpu_decodable(_jpeg(photo))
    assert gpu_decodable(_jpeg(photo.convert("L")))
    assert gpu_decodable(_jpeg(photo, exif=upright))
    assert not gpu_decodable(_jpeg(photo, progressive=True))
    assert not gpu_decodable(_jpeg(photo.convert("CMYK")))
    assert not gpu_decodable(_jpeg(photo, exif=exif))
    assert not gpu_decodable(png.getvalue())
    assert not gpu_decodable(b"\xff\xd8\xff" + b"\x00" * 64)  # a JPEG's first bytes, then nothing readable
    defer = DeferToGpu()
    assert defer("a", png.getvalue()) is None
    deferred = defer("a", _jpeg(photo))
    assert isinstance(deferred, EncodedJpeg) and deferred.data.numpy().tobytes() == _jpeg(photo)


def test_a_share_of_the_jpegs_goes_to_the_gpu_the_same_ones_every_time():
    data = _jpeg(_photos(1)[0])
    keys = [f"shard3/{index:06d}" for index in range(2000)]
    half = [key for key in keys if DeferToGpu(0.5)(key, data) is not None]
    assert 900 < len(half) < 1100  # about the share, by key
    assert half == [key for key in keys if DeferToGpu(0.5)(key, data) is not None]  # another process, same keys
    fifth = {key for key in keys if DeferToGpu(0.2)(key, data) is not None}
    assert fifth < set(half) and 300 < len(fifth) < 500  # a smaller share takes a subset: the order is fixed
    assert all(DeferToGpu(0.0)(key, data) is None for key in keys[:50])
    assert all(DeferToGpu(1.0)(key, data) is not None for key in keys[:50])


def test_pack_keeps_each_image_in_its_place():
    jpegs = [_jpeg(photo) for photo in _photos(3)]
    host = [torch.full((3, 8, 8), value, dtype=torch.uint8) for value in (10, 20)]
    images = [EncodedJpeg(torch.frombuffer(bytearray(jpegs[0]), dtype=torch.uint8)), host[0],
              EncodedJpeg(torch.frombuffer(bytearray(jpegs[1]), dtype=torch.uint8)), host[1],
              EncodedJpeg(torch.frombuffer(bytearray(jpegs[2]), dtype=torch.uint8))]
    packed = pack(images)
    assert packed["on_gpu"].tolist() == [True, False, True, False, True]
    assert torch.equal(packed["pixels"], torch.stack(host))
    parts = torch.split(packed["jpeg_bytes"], packed["jpeg_lengths"].tolist())
    assert [part.numpy().tobytes() for part in parts] == jpegs


def _host_pixels(data: bytes, size: int, channels: int) -> torch.Tensor:
    transform = eval_transform(size, channels, normalize=False)  # full decode: as nvJPEG decodes
    return transform(PIL.Image.open(io.BytesIO(data)))


@pytest.mark.parametrize("channels", [3, 1])
def test_decoded_batch_equals_the_host_transform(channels):
    photos = _photos(4)
    jpegs = [_jpeg(photo) for photo in photos]
    size = 96
    # Two decoded on the "GPU" (here the CPU device), two by the workers, interleaved.
    images = [EncodedJpeg(torch.frombuffer(bytearray(jpegs[0]), dtype=torch.uint8)),
              _host_pixels(jpegs[1], size, channels),
              EncodedJpeg(torch.frombuffer(bytearray(jpegs[2]), dtype=torch.uint8)),
              _host_pixels(jpegs[3], size, channels)]
    decoder = JpegBatchDecoder(torch.device("cpu"), size, channels, lambda data: _host_pixels(data, size, channels))
    pixels, good = decoder(pack(images))
    assert good.all() and pixels.shape == (4, channels, size, size) and pixels.dtype == torch.uint8
    want = torch.stack([_host_pixels(data, size, channels) for data in jpegs])
    assert torch.equal(pixels[[1, 3]], want[[1, 3]])  # the workers' pixels, in their places
    # The decoded ones: libjpeg both, but resized from another decoder's output (torchvision's vs PIL's,
    # and PIL's luma for a gray tower against the JPEG's own Y channel): within a few levels.
    difference = (pixels[[0, 2]].int() - want[[0, 2]].int()).abs()
    assert difference.float().mean() < 1.0 and difference.max() <= 8


def test_a_jpeg_no_decoder_reads_is_left_out_and_the_rest_kept():
    photos = _photos(3)
    jpegs = [_jpeg(photo) for photo in photos]
    broken = jpegs[1][: len(jpegs[1]) // 3]  # its header is whole: it goes to the GPU, which fails on it
    assert gpu_decodable(broken)
    images = [EncodedJpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8))
              for data in (jpegs[0], broken, jpegs[2])]
    host_calls = []

    def host_decode(data: bytes) -> torch.Tensor:
        host_calls.append(data)
        return _host_pixels(data, 64, 3)  # PIL refuses the truncated file too

    pixels, good = JpegBatchDecoder(torch.device("cpu"), 64, 3, host_decode)(pack(images))
    assert good.tolist() == [True, False, True] and pixels.shape == (2, 3, 64, 64)
    assert host_calls == [broken]  # the host decoder was tried on the broken one alone
    want = torch.stack([_host_pixels(jpegs[0], 64, 3), _host_pixels(jpegs[2], 64, 3)])
    assert np.abs(pixels.int().numpy() - want.int().numpy()).mean() < 1.0


def test_a_reduced_decode_is_mimicked_after_the_full_one():
    """A tower whose preprocess says decode=reduced sees DCT-scaled JPEGs on the host; the GPU decodes in
    full, then box-averages by the same factor to the same size: close to the host's pixels, where
    skipping the reduction leaves them visibly apart."""
    from torchvision.io import decode_jpeg

    from lit_softmoe.data.gpu_jpeg import ResizeCrop, dct_scale
    from lit_softmoe.data.images import jpeg_min_side
    size = 48
    min_side = jpeg_min_side("reduced", size)  # 96: a 512 px photo decodes at 1/4 on the host
    assert dct_scale(512, 300, min_side) == 2 and dct_scale(512, 512, min_side) == 4 and dct_scale(150, 900, 96) == 1
    for photo in _photos(4):
        data = _jpeg(photo)
        host = eval_transform(size, 3, decode="reduced", normalize=False)(PIL.Image.open(io.BytesIO(data)))
        full = decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        reduce_first, full_size = (ResizeCrop(size, side, full.device, torch.float32) for side in (min_side, None))
        mimicked = (reduce_first([full])[0].int() - host.int()).abs().float().mean()
        unreduced = (full_size([full])[0].int() - host.int()).abs().float().mean()
        assert mimicked < 0.5 and mimicked < 0.8 * unreduced, (mimicked, unreduced)


def test_resize_crop_as_matrices_equals_the_steps_it_replaces():
    """`ResizeCrop`'s two matrix products per image against the steps themselves (box average, antialiased
    resize of the shorter side, center crop), for a batch of images of different sizes and orientations:
    the same pixels up to the final rounding."""
    import torch.nn.functional as F
    from torchvision.transforms.v2 import functional as TF

    from lit_softmoe.data.gpu_jpeg import ResizeCrop, dct_scale
    generator = torch.Generator().manual_seed(0)
    shapes = [(3, 130, 97), (3, 97, 130), (3, 400, 333), (3, 1000, 700), (3, 64, 64), (3, 400, 333)]
    images = [torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8) for shape in shapes]
    size, min_side = 48, 96
    resize = ResizeCrop(size, min_side, torch.device("cpu"), torch.float32)
    got = resize(images)
    assert got.shape == (len(shapes), 3, size, size) and got.dtype == torch.uint8
    for image, pixels in zip(images, got):
        scale = dct_scale(*image.shape[-2:], min_side)
        reduced = F.avg_pool2d(image[None].float(), scale, ceil_mode=True)[0]
        want = TF.center_crop(TF.resize(reduced, [size], antialias=True), [size, size]).round().clamp(0, 255)
        difference = (pixels.float() - want).abs()
        assert difference.max() <= 1 and difference.mean() < 0.01, (image.shape, difference.max())
    # One matrix per (side length, reduction, resized length): 130 x 97 and 97 x 130 share theirs, a square
    # one needs one, the repeated 400 x 333 reuses its two.
    assert len(resize._matrices) == 7


def test_images_of_any_sizes_are_resized_together_to_the_pixels_each_gets_alone(monkeypatch):
    """Photos come in as many sizes as there are photos: a batch of them goes through one pair of batched
    products (their pixels and matrices zero-padded to the largest), not a few kernels per image, and each
    image gets the pixels it gets alone. A chunk limit splits the batch, largest first, to the same pixels."""
    from torchvision.transforms.v2.functional import pil_to_tensor

    from lit_softmoe.data.gpu_jpeg import ResizeCrop
    photos = _photos(4)
    sizes = [(256, 256)] * 4 + [(341, 256)] * 2 + [(130, 97), (97, 130), (700, 500)]
    images = [pil_to_tensor(photos[i % 4].resize(size)) for i, size in enumerate(sizes)]
    images = images[:3] + images[5:] + images[3:5]  # the sizes interleaved: each image keeps its place
    products = []
    bmm = torch.bmm

    def counting(a, b):
        products.append(a.shape[0])
        return bmm(a, b)

    resize = ResizeCrop(48, 96, torch.device("cpu"), torch.float32)
    monkeypatch.setattr(torch, "bmm", counting)
    together = resize(images)
    assert products == [9, 9]  # one pair of products for the nine images
    products.clear()
    alone = torch.cat([resize([image]) for image in images])
    assert products == [1, 1] * 9
    # Padding adds exact zeros, but the products sum over more terms in another order: float32 rounding
    # (~1e-5 of a 0-255 level) can move a value across a .5 boundary, one level at most, and rarely.
    difference = (together.int() - alone.int()).abs()
    assert together.shape == (9, 3, 48, 48) and difference.max() <= 1 and difference.float().mean() < 1e-3
    products.clear()
    # A limit of three of the largest padded images: the largest go three to a chunk, smaller ones more.
    parts = [resize._parts(image) for image in images]
    spans = [(rows.shape[1], cols.shape[1]) for rows, _, cols, _ in parts]
    resize.chunk_bytes = 3 * 3 * 4 * max(h for h, _ in spans) * max(w for _, w in spans)  # n * C * float32
    chunks = resize._chunks(parts, 3)
    assert sorted(i for chunk in chunks for i in chunk) == list(range(9)) and 1 < len(chunks) < 9
    for chunk in chunks:
        padded = len(chunk) * 3 * 4 * max(spans[i][0] for i in chunk) * max(spans[i][1] for i in chunk)
        assert padded <= resize.chunk_bytes
    chunked = resize(images)
    assert products == [len(chunk) for chunk in chunks for _ in range(2)]
    assert (chunked.int() - together.int()).abs().max() <= 1
