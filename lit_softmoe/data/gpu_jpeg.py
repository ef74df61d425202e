"""JPEG decoding on the GPU, for jobs that run a locked tower over many images
(`lit-softmoe embed`).

Decoding is what keeps a GPU waiting: host cores decode and resize large photos at a fraction of
the rate a B/16 tower embeds them (docs/benchmarks.md). nvJPEG decodes on the GPU instead
(`torchvision.io.decode_jpeg(list, device="cuda")`, batched), and the resize and center crop run
there too (`ResizeCrop`). The host workers pass a share of the JPEGs on
undecoded (`DeferToGpu`: their bytes, `EncodedJpeg`) and decode the rest as before, so that both
decoders work; the process that owns the GPU decodes the deferred ones a batch at a time
(`JpegBatchDecoder`).

Not every file goes that way. `gpu_decodable` sends to the host decoder, as before, whatever nvJPEG
would decode differently or not at all: other formats (PNG, WebP), CMYK/YCCK and Adobe-RGB JPEGs,
progressive ones, and those carrying an EXIF orientation to apply. A JPEG that nvJPEG still refuses
is decoded on the host by the main process (`JpegBatchDecoder`'s `host_decode`). The pixels differ
from the host path's only as two JPEG decoders and a full against a DCT-reduced decode differ: the
features agree within cosine 0.999 (tests/test_cuda.py).
"""
from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass
from typing import Callable, Sequence

import PIL.Image
import torch
import torch.nn.functional as F

from lit_softmoe.data.images import exif_orientation, open_undecoded
from lit_softmoe.errors import UserError, first_line, spelled

DECODERS = ("auto", "gpu", "cpu")
_JPEG_START = b"\xff\xd8\xff"


@dataclass
class EncodedJpeg:
    """A JPEG left for the GPU to decode: its bytes as a 1-D uint8 tensor."""
    data: torch.Tensor


def gpu_decodable(data: bytes) -> bool:
    """Whether nvJPEG decodes `data` to the pixels the host path gives: a baseline or extended
    sequential JPEG in gray or YCbCr, upright. Reads the header only (PIL opens files lazily)."""
    if not data.startswith(_JPEG_START):
        return False
    try:
        with open_undecoded(data) as image:
            return (image.format == "JPEG" and image.mode in ("L", "RGB")
                    and "adobe" not in image.info  # Adobe's marker: RGB or YCCK stored as-is
                    and not image.info.get("progressive") and not image.info.get("progression")
                    and exif_orientation(image) not in range(2, 9))  # the host path rotates those
    except Exception:  # noqa: BLE001 — not even a header: the host decoder counts it as a bad image
        return False


class DeferToGpu:
    """The worker side: `defer(key, data)` is the JPEG `data` as an `EncodedJpeg` when the GPU
    decodes it, else None (the worker decodes it).

    `share`: the fraction of the JPEGs the GPU takes; below 1 the workers decode the others, so that
    both decoders work (where each alone feeds about as many images as the other:
    docs/benchmarks.md, "embed"). Which images go where is a function of the sample key alone, so
    the same shards give the same features on every run.
    """

    def __init__(self, share: float = 1.0):
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"share must be in [0, 1], got {share}")
        self.share = share

    def __call__(self, key: str, data: bytes) -> EncodedJpeg | None:
        if self.share < 1.0 and _unit_hash(key) >= self.share:
            return None
        if not gpu_decodable(data):
            return None
        return EncodedJpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8))


def _unit_hash(key: str) -> float:
    """`key` → a number in [0, 1), uniform over keys and the same in every process and run."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") / 2.0**64


def pack(images: Sequence[torch.Tensor | EncodedJpeg]) -> dict[str, torch.Tensor]:
    """A batch of host-decoded pixels (C, S, S) and `EncodedJpeg`s as a few tensors, cheap to send
    from a DataLoader worker (one shared-memory segment each, not one per image):
    {"pixels": (n_host, C, S, S) uint8, "jpeg_bytes": (total,) uint8, "jpeg_lengths": (n_gpu,)
    int64, "on_gpu": (B,) bool, in batch order}."""
    on_gpu = torch.tensor([isinstance(image, EncodedJpeg) for image in images], dtype=torch.bool)
    host = [image for image in images if not isinstance(image, EncodedJpeg)]
    encoded = [image.data for image in images if isinstance(image, EncodedJpeg)]
    return {"pixels": torch.stack(host) if host else torch.empty(0, dtype=torch.uint8),
            "jpeg_bytes": torch.cat(encoded) if encoded else torch.empty(0, dtype=torch.uint8),
            "jpeg_lengths": torch.tensor([len(data) for data in encoded], dtype=torch.int64),
            "on_gpu": on_gpu}


def dct_scale(height: int, width: int, min_side: int | None) -> int:
    """The factor (1, 2, 4 or 8) by which the host decodes a JPEG of `height` × `width` for
    `min_side` (`images.draft_jpeg`: PIL's `draft`, libjpeg's DCT scaling)."""
    if not min_side or min(height, width) // min_side < 2:
        return 1
    fit = min(height, width) // min_side
    return next(scale for scale in (8, 4, 2, 1) if fit >= scale)


class ResizeCrop:
    """uint8 images (C, H, W) of any sizes → one uint8 batch (N, C, size, size), each as
    `transforms.eval_transform` makes it on the host: reduced first as the host's DCT-scaled decode
    for `min_side` reduces it (a box average over the same factor, to ceil(H / factor) × ceil(W /
    factor)), then the shorter side resized to `size` (bilinear, antialiased) and the center square
    taken.

    All three steps are linear and act on rows and columns apart, so each image is two matrix
    products, (size, H) @ image @ (W, size). Photos come in as many sizes as there are photos, and a
    few kernels launched from Python per image is what bounded resizing thousands of them a second.
    So the images go through the products together, whatever their sizes: each is copied (one C++
    call for all, `_foreach_copy_`) into a zero-padded stack, its matrices into zero-padded stacks
    beside it, and two batched products resize them all; the zeros add nothing. Images are taken
    largest first, in chunks of at most `chunk_bytes` of padded pixels, so that one large photo does
    not pad a whole batch to its size. A matrix depends on the side's length only and is made once,
    by running the steps themselves on an identity (kept per length: photos of a dataset come in few
    sizes), and only the span of pixels it weighs is copied (the center crop drops the rest).
    `dtype`: of the products (bf16 on a GPU: pixels 0-255 are exact, the result is rounded to uint8
    as the host's is).
    """

    def __init__(self, size: int, min_side: int | None, device: torch.device, dtype: torch.dtype,
                 chunk_bytes: int = 512 << 20):
        self.size, self.min_side, self.device, self.dtype = size, min_side, device, dtype
        self.chunk_bytes = chunk_bytes
        self._matrices: dict[tuple[int, int, int], tuple[torch.Tensor, slice]] = {}

    def __call__(self, images: Sequence[torch.Tensor]) -> torch.Tensor:
        channels = images[0].shape[0] if images else 1
        out = torch.empty(len(images), channels, self.size, self.size, dtype=self.dtype,
                          device=self.device)
        parts = [self._parts(image) for image in images]  # (rows, row_span, cols, col_span) each
        for chunk in self._chunks(parts, channels):
            resized = self._resize_together([images[i] for i in chunk], [parts[i] for i in chunk])
            out.index_copy_(0, to_device_async(torch.tensor(chunk), self.device), resized)
        return out.round_().clamp_(0, 255).to(torch.uint8)  # (N, C, size, size)

    def _parts(self, image: torch.Tensor) -> tuple[torch.Tensor, slice, torch.Tensor, slice]:
        height, width = image.shape[-2:]
        scale = dct_scale(height, width, self.min_side)
        resized_h, resized_w = _resized_size(-(-height // scale), -(-width // scale), self.size)
        rows, row_span = self._matrix(height, scale, resized_h)  # (size, H')
        cols, col_span = self._matrix(width, scale, resized_w)  # (size, W')
        return rows, row_span, cols, col_span

    def _chunks(self, parts, channels: int) -> list[list[int]]:
        """Image indices, largest span first, grouped so that each group's padded stack (n, H', C,
        W') stays within `chunk_bytes` (a group holds one image at least)."""
        def height_width(index):
            return parts[index][0].shape[1], parts[index][2].shape[1]
        order = sorted(range(len(parts)), key=lambda i: height_width(i)[0] * height_width(i)[1],
                       reverse=True)
        item_bytes = torch.finfo(self.dtype).bits // 8 * channels
        chunks, height, width = [], 0, 0
        for index in order:
            h, w = height_width(index)
            if chunks and ((len(chunks[-1]) + 1) * max(height, h) * max(width, w) * item_bytes
                           <= self.chunk_bytes):
                chunks[-1].append(index)
                height, width = max(height, h), max(width, w)
            else:
                chunks.append([index])
                height, width = h, w
        return chunks

    def _resize_together(self, images: Sequence[torch.Tensor], parts) -> torch.Tensor:
        """The images (C, H, W) of one chunk, resized and cropped together: (n, C, size, size) in
        `dtype`."""
        n, channels = len(images), images[0].shape[0]
        # Padded to multiples of 8 as well: tensor-core products want their inner dimensions
        # aligned.
        height = -(-max(rows.shape[1] for rows, _, _, _ in parts) // 8) * 8
        width = -(-max(cols.shape[1] for _, _, cols, _ in parts) // 8) * 8
        # (n, H', C, W')
        pixels = torch.zeros(n, height, channels, width, dtype=self.dtype, device=self.device)
        # (n, size, H')
        rows = torch.zeros(n, self.size, height, dtype=self.dtype, device=self.device)
        # (n, size, W')
        cols = torch.zeros(n, self.size, width, dtype=self.dtype, device=self.device)
        targets, sources = [], []
        for i, (image, (row_weights, row_span, col_weights, col_span)) in enumerate(
                zip(images, parts)):
            crop = image[:, row_span, col_span]  # (C, h, w): the pixels the center crop weighs
            targets += [pixels[i, :crop.shape[1], :, :crop.shape[2]].transpose(0, 1),
                        rows[i, :, :row_weights.shape[1]], cols[i, :, :col_weights.shape[1]]]
            sources += [crop, row_weights, col_weights]
        torch._foreach_copy_(targets, sources)  # one call, casting to `dtype` as it copies
        resized = torch.bmm(rows, pixels.view(n, height, channels * width))  # (n, size, C * W')
        # (n, size * C, size)
        resized = torch.bmm(resized.view(n, self.size * channels, width), cols.transpose(1, 2))
        return resized.view(n, self.size, channels, self.size).transpose(1, 2)  # (n, C, size, size)

    def _matrix(self, length: int, scale: int, resized: int) -> tuple[torch.Tensor, slice]:
        """(size, length') weights of the input pixels in each output pixel along one side, and the
        span of the input (length' long) with any weight."""
        key = (length, scale, resized)
        if key not in self._matrices:
            # a source of ever new sizes: start over rather than grow
            if len(self._matrices) >= 1024:
                self._matrices.clear()
            # column j: a delta at input pixel j
            basis = torch.eye(length, device=self.device)[None, None]
            if scale > 1:
                basis = F.avg_pool2d(basis, (scale, 1), ceil_mode=True)
            basis = F.interpolate(basis, size=(resized, length), mode="bilinear", antialias=True,
                                  align_corners=False)
            start = int(round((resized - self.size) / 2.0))  # transforms.v2's center crop
            weights = basis[0, 0, start:start + self.size]  # (size, length)
            used = weights.abs().sum(0).nonzero().flatten()
            span = slice(int(used.min()), int(used.max()) + 1)
            self._matrices[key] = (weights[:, span].to(self.dtype).contiguous(), span)
        return self._matrices[key]


def to_device_async(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` (on the host) on `device` without waiting: a copy from pageable memory waits for the
    work queued on the stream before it starts (CUDA's "API synchronization behavior"), which in the
    decode thread meant waiting for the kernels queued behind the tower's at every index tensor;
    from pinned memory it is queued like a kernel (PyTorch keeps the pinned block until the copy is
    done)."""
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def _resized_size(height: int, width: int, size: int) -> tuple[int, int]:
    """(height, width) after transforms.v2's resize of the shorter side to `size` (the longer one
    truncated)."""
    if width <= height:
        return int(size * height / width), size
    return size, int(size * width / height)


class JpegBatchDecoder:
    """Decodes `pack`ed batches on `device`: `decoder(packed)` → (uint8 pixels (n_good, channels,
    size, size) on `device`, good (B,) bool).

    The JPEGs are decoded together; if nvJPEG refuses the batch (a file it cannot read), each is
    tried alone, and one it refuses is decoded on the host by `host_decode` (bytes → uint8 (C, size,
    size)); one that fails there too is left out (`good` False) for the caller to count. `min_side`:
    the tower's reduced decode (`ResizeCrop`), None for a full one.

    Streams: torchvision allocates the decoded images on the current stream but writes them from its
    own, without waiting for the current stream. On the stream the tower runs on, that memory may be
    what the previous batch's forward, still queued, is using (the caching allocator hands a freed
    block to the next allocation on the same stream at once): decoding there corrupted features in
    flight. So the decode runs with a stream of its own current (its allocations come from that
    stream's pool), the tower's stream waits for it, and the images are marked as used there. The
    bytes of the batch are kept until the next decode, which starts by waiting for this one (nvJPEG
    may still read them).
    """

    def __init__(self, device: torch.device, size: int, channels: int,
                 host_decode: Callable[[bytes], torch.Tensor], min_side: int | None = None):
        self.device, self.size, self.channels, self.min_side = device, size, channels, min_side
        self.host_decode = host_decode
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.resize = ResizeCrop(size, min_side, device,
                                 torch.bfloat16 if device.type == "cuda" else torch.float32)
        self._in_use: dict | None = None

    def __call__(self, packed: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        from torchvision.io import ImageReadMode

        on_gpu, device = packed["on_gpu"], self.device
        batch = torch.empty(len(on_gpu), self.channels, self.size, self.size, dtype=torch.uint8,
                            device=device)
        good = torch.ones(len(on_gpu), dtype=torch.bool)
        host_pixels = packed["pixels"]
        # by index, not by a mask on the device: a mask would wait for the queued forward
        if len(host_pixels):
            on_host = to_device_async((~on_gpu).nonzero().flatten(), device)
            batch.index_copy_(0, on_host, to_device_async(host_pixels, device))
        if not on_gpu.any():
            return batch, good
        encoded = list(torch.split(packed["jpeg_bytes"], packed["jpeg_lengths"].tolist()))
        decoded = self._decode(encoded,
                               ImageReadMode.RGB if self.channels == 3 else ImageReadMode.GRAY)
        self._in_use = packed
        positions, images = [], []
        for index, data, image in zip(on_gpu.nonzero().flatten().tolist(), encoded, decoded):
            if image is not None:
                positions.append(index)
                images.append(image)
                continue
            try:  # nvJPEG cannot read it: the host decoder may (or counts it as broken)
                batch[index] = self.host_decode(data.numpy().tobytes()).to(device)
            except Exception:  # noqa: BLE001 — a broken file: counted by the caller,
                # the run goes on
                good[index] = False
        if images:
            batch.index_copy_(0, to_device_async(torch.tensor(positions), device),
                              self.resize(images))
        if not good.all():
            batch = batch.index_select(0, to_device_async(good.nonzero().flatten(), device))
        return batch, good

    def _decode(self, encoded: list[torch.Tensor], mode) -> list[torch.Tensor | None]:
        if self.stream is None:
            return _decode_each_or_none(encoded, mode, self.device)
        current = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            decoded = _decode_each_or_none(encoded, mode, self.device)
        current.wait_stream(self.stream)
        for image in decoded:
            if image is not None:
                image.record_stream(current)  # freed only once the tower's stream is done with it
        return decoded


def _decode_each_or_none(encoded: list[torch.Tensor], mode,
                         device: torch.device) -> list[torch.Tensor | None]:
    """The batch decoded at once, or, when that fails (one file it cannot read fails the whole
    batch), one by one, None for each it cannot read."""
    from torchvision.io import decode_jpeg
    try:
        return decode_jpeg(encoded, mode=mode, device=device)
    except RuntimeError:
        return [_decode_one(data, mode, device) for data in encoded]


def _decode_one(data: torch.Tensor, mode, device: torch.device) -> torch.Tensor | None:
    from torchvision.io import decode_jpeg
    try:
        return decode_jpeg(data, mode=mode, device=device)
    except RuntimeError:
        return None


def gpu_decoder_works(device: torch.device) -> str | None:
    """None when torchvision decodes JPEGs on `device`, else why not (one line): no CUDA device, or
    a torchvision built without nvJPEG."""
    if device.type != "cuda":
        return f"the tower runs on {device.type}"
    from torchvision.io import decode_jpeg
    buffer = io.BytesIO()
    PIL.Image.new("RGB", (16, 16), (200, 30, 90)).save(buffer, "JPEG")
    try:
        decode_jpeg(torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8),
                    device=device)
    except (RuntimeError, NotImplementedError) as err:
        return f"torchvision cannot decode on {device} ({first_line(err)})"
    return None


def choose_decoder(setting: str, device: torch.device,
                   setting_name: str = "jpeg_decoder") -> tuple[str, str]:
    """("gpu" | "cpu", why) for the decoder `setting` (one of `DECODERS`): auto takes the GPU where
    torchvision can decode there (`gpu_decoder_works`); gpu where it cannot is a UserError. The why
    and the error call the setting `setting_name`, the caller's name for it (embed's
    --jpeg-decoder)."""
    if setting == "cpu":
        return "cpu", spelled(setting_name, "cpu")
    problem = gpu_decoder_works(device)
    if setting == "gpu":
        if problem is not None:
            raise UserError(f"{spelled(setting_name, 'gpu')}: {problem}; leave it at auto (or "
                            "cpu) to decode on the host")
        return "gpu", spelled(setting_name, "gpu")
    return (("cpu", f"auto: {problem}") if problem
            else ("gpu", "auto: nvJPEG; other images on the host"))


def decoder_words(decoder: str, share: float) -> str:
    """Where the JPEGs are decoded, in words ("on the GPU (50%) and by the workers"): `share` is the
    fraction the GPU decodes (`DeferToGpu`)."""
    if decoder == "cpu":
        return "on the CPU"
    return "on the GPU" if share == 1.0 else f"on the GPU ({share:.0%}) and by the workers"
