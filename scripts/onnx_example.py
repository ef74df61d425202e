"""Embed one image and one caption with an exported pair: onnxruntime + numpy + PIL + tokenizers, no torch.

    lit-softmoe export RUN --out DIR --onnx
    python scripts/onnx_example.py DIR image.png "a photo of a sneaker" [embeddings.npz]

The block between the markers is the example of docs/export.md, verbatim (a test keeps them equal
and runs this file with torch and lit_softmoe made unimportable).
"""
import os.path
import sys

# Outside the example: a missing argument or an export without --onnx in one line, not a traceback.
if len(sys.argv) < 4:
    sys.exit(f"usage: python {sys.argv[0]} EXPORT_DIR IMAGE CAPTION [embeddings.npz]")
if not all(os.path.isfile(os.path.join(sys.argv[1], name))
           for name in ("image_encoder.onnx", "text_encoder.onnx", "tokenizer.json")):
    sys.exit(f"{sys.argv[1]} has no image_encoder.onnx, text_encoder.onnx and tokenizer.json: export a LiT run with "
              f"`lit-softmoe export RUN --out {sys.argv[1]} --onnx` (add --overwrite to replace this folder)")
# --- example start
import json
import sys

import numpy as np
import onnxruntime as ort
from PIL import Image, ImageOps
from tokenizers import Tokenizer  # installed with transformers; `pip install tokenizers` alone works too

export_dir, image_path, caption = sys.argv[1:4]

pre = json.load(open(f"{export_dir}/config.json"))["preprocess"]
size = pre["image_size"]
image, min_side = Image.open(image_path), pre.get("jpeg_min_side")  # min_side: the export's decode="reduced"
if min_side and image.format in ("JPEG", "MPO") and min(image.size) >= 2 * min_side:
    image.draft(image.mode, (min_side, min_side))  # a large JPEG decoded at 1/2-1/8 scale, as embed decoded it
image = ImageOps.exif_transpose(image)  # upright, as training saw it
if image.mode in ("I", "I;16", "I;16B", "I;16L"):  # 16-bit gray: scale to 8 bits (convert would clip at 255)
    image = Image.fromarray(((np.asarray(image, np.int64).clip(0, 65535) * 255 + 32767) // 65535).astype(np.uint8))
if image.has_transparency_data:  # transparent pixels on white, as in training
    image = Image.alpha_composite(Image.new("RGBA", image.size, "white"), image.convert("RGBA"))
image = image.convert(pre["mode"])  # "L" or "RGB", as the tower takes (PIL's own RGB → gray)
short, long = sorted(image.size)  # resize the shorter side to `size`, then crop the center
resized = (size, int(size * long / short))
image = image.resize(resized if image.width <= image.height else resized[::-1], Image.BILINEAR)
left, top = round((image.width - size) / 2), round((image.height - size) / 2)
image = image.crop((left, top, left + size, top + size))
pixels = np.asarray(image, dtype=np.float32).reshape(size, size, -1).transpose(2, 0, 1) / 255  # (C, H, W)
pixels = (pixels - np.float32(pre["mean"])[:, None, None]) / np.float32(pre["std"])[:, None, None]

ids = np.array([Tokenizer.from_file(f"{export_dir}/tokenizer.json").encode(caption).ids], dtype=np.int64)  # (1, L)
image_embedding = ort.InferenceSession(f"{export_dir}/image_encoder.onnx").run(None, {"pixels": pixels[None]})[0]
text_embedding = ort.InferenceSession(f"{export_dir}/text_encoder.onnx").run(None, {"ids": ids})[0]
print("cosine similarity:", float(image_embedding[0] @ text_embedding[0]))  # both (1, D), unit length
# --- example end
if len(sys.argv) > 4:
    np.savez(sys.argv[4], image=image_embedding, text=text_embedding, pixels=pixels)
