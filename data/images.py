"""Images: checked and measured from their headers (EXIF orientation applied), loaded resized and
centre-cropped, saved as PNG grids.

    python -m pytest tests/test_data.py -q
"""
from __future__ import annotations

import functools
import hashlib
import math
import os

import torch

def check_image(source) -> tuple[int, int]:
    """Open and verify an image (a path or a DatasetImage); returns its (height, width) as shown,
    i.e. after its EXIF orientation. A missing or undecodable file: ValueError naming it."""
    from PIL import Image
    if isinstance(source, str) and not os.path.isfile(source):
        raise ValueError(f"image {source} not found")
    try:
        with Image.open(_opened(source)) as im:
            size = _shown_size(im)
            im.verify()
    except Exception as e:  # noqa: BLE001 - any decoder failure means a corrupt file
        raise ValueError(f"image {source} is unreadable ({type(e).__name__})") from None
    return size


def _opened(source):
    return source if isinstance(source, str) else source.open()


def exif_orientation(im) -> int:
    """The EXIF orientation tag (1-8; 1 = as stored) from the file's header, without decoding the
    pixels (PIL's getexif() would decode a PNG that has no EXIF; an eXIf chunk placed after the
    pixel data is seen only by load_image, which decodes anyway)."""
    from PIL import Image
    raw = im.info.get("exif")
    if raw:
        exif = Image.Exif()
        exif.load(raw)
        return int(exif.get(0x0112, 1) or 1)
    return int(im.getexif().get(0x0112, 1) or 1) if im.format == "TIFF" else 1


def image_size(source) -> tuple[int, int]:
    """(height, width) of an image as shown (EXIF orientation applied), from its header."""
    from PIL import Image
    with Image.open(_opened(source)) as im:
        return _shown_size(im)


def _shown_size(im) -> tuple[int, int]:
    """(height, width) after the EXIF orientation (5-8 turn the image a quarter)."""
    return (im.width, im.height) if exif_orientation(im) in (5, 6, 7, 8) else (im.height, im.width)


def load_image(source, height: int, width: int, *, stretch: bool = False, mirror: bool = False) -> torch.Tensor:
    """(3, height, width) in [-1, 1] of an image file (or a DatasetImage), turned upright by its
    EXIF orientation (phone photos; as diffusers' scripts do), mirrored left-right with `mirror`,
    then resized (Lanczos) to cover the size and centre-cropped, or with `stretch` resized to
    exactly that size, as the editing pipelines' image processors do (diffusers VaeImageProcessor
    .resize of a PIL image: Lanczos, no crop). An image already of that size is returned unchanged
    (PIL's resize to the same size copies; without an orientation tag exif_transpose copies too)."""
    from PIL import Image, ImageOps
    with Image.open(_opened(source)) as im:
        im = ImageOps.exif_transpose(im).convert("RGB")
        if mirror:
            im = ImageOps.mirror(im)
        if stretch:
            im = im.resize((width, height), Image.Resampling.LANCZOS)
        else:
            scale = max(height / im.height, width / im.width)
            rw, rh = max(width, math.ceil(im.width * scale)), max(height, math.ceil(im.height * scale))
            im = im.resize((rw, rh), Image.Resampling.LANCZOS)
            left, top = (rw - width) // 2, (rh - height) // 2
            im = im.crop((left, top, left + width, top + height))
        return pil_tensor(im)


def pil_tensor(im) -> torch.Tensor:
    """An RGB PIL image as (3, H, W) in [-1, 1] (the image processors' to_tensor then normalize), in numpy's
    (H, W, C) memory order, as their output is laid out."""
    import numpy as np
    return torch.from_numpy(np.asarray(im, dtype=np.uint8).copy()).permute(2, 0, 1).float() / 127.5 - 1.0


@functools.lru_cache(maxsize=1 << 16)
def _file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def image_digest(source) -> str:
    """An image's sha256, a text cache's key part: a file's bytes (read once per path), else its pixels'."""
    if isinstance(source, str):
        return _file_digest(source)
    import numpy as np
    return hashlib.sha256(np.asarray(load_pil(source)).tobytes()).hexdigest()


def load_pil(source, mirror: bool = False):
    """An image file (or a DatasetImage) as an upright RGB PIL image, as a pipeline is given it
    (mirrored left-right with `mirror`)."""
    from PIL import Image, ImageOps
    with Image.open(_opened(source)) as im:
        im = ImageOps.exif_transpose(im).convert("RGB")
        return ImageOps.mirror(im) if mirror else im


def save_image_grid(images: torch.Tensor, path: str, nrow: int) -> None:
    """(N,3,H,W) in [-1,1] -> one PNG grid with `nrow` images per row."""
    import numpy as np
    from PIL import Image
    images = ((images.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).cpu()
    n, c, h, w = images.shape
    rows = math.ceil(n / nrow)
    grid = torch.zeros(c, rows * h, nrow * w, dtype=torch.uint8)
    for i in range(n):
        r, col = divmod(i, nrow)
        grid[:, r * h:(r + 1) * h, col * w:(col + 1) * w] = images[i]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    Image.fromarray(np.ascontiguousarray(grid.permute(1, 2, 0).numpy())).save(path)
