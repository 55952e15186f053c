"""The environment step of ``bench/gpu/run.sh``: torch and its devices, DALI, and which CUDA
libraries DALI really loads.

DALI loads nvJPEG, NPP and the CUDA runtime lazily, from wherever its search finds them first
(its own wheel folders, the packed ``.gpu/site``, or the image's). So this decodes one small
JPEG with ``device="mixed"`` and then lists the CUDA libraries mapped into the process
(``/proc/self/maps``), with DALI's own version queries. It also names the packages of
``.gpu/site`` that the image has too (the DALI steps see the packed copy first). Exits non-zero
when torch sees no CUDA device, as the rest of the run needs one.
"""

from __future__ import annotations

import importlib.machinery
import io
import os
import re
import sys
from pathlib import Path

_CUDA_LIBS = re.compile(r"lib(cudart|nvjpeg|npp\w*|nvimgcodec\w*|nvcomp\w*|cufile|nvrtc|cuda)\.so")


def loaded_cuda_libs() -> list[str]:
    """Paths of the CUDA libraries mapped into this process."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    paths = {line.split()[-1] for line in maps if "/" in line}
    return sorted(p for p in paths if _CUDA_LIBS.search(os.path.basename(p)))


def dali_report() -> None:
    try:
        import nvidia.dali as dali
        import nvidia.dali.backend as backend
    except ImportError as exc:
        print(f"dali: not importable ({exc})")
        return
    print("dali", dali.__version__, "from", os.path.dirname(dali.__file__))
    for name in ("GetCudaVersion", "GetNppVersion", "GetNvjpegVersion", "GetNvimgcodecVersion"):
        fn = getattr(backend, name, None)
        try:
            print(f"  {name}: {fn() if fn else 'absent'}")
        except Exception as exc:  # a library DALI cannot find raises here
            print(f"  {name}: error {exc}")
    try:
        decode_one_jpeg(dali)
        print("  mixed decode of one JPEG: ok")
    except Exception as exc:  # reported; the GPU tests show what it breaks
        print(f"  mixed decode of one JPEG failed: {type(exc).__name__}: {exc}".splitlines()[0])
    print("  CUDA libraries loaded now:")
    for path in loaded_cuda_libs():
        print("   ", path)


def decode_one_jpeg(dali: object) -> None:
    import numpy as np
    from nvidia.dali import fn, pipeline_def
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.full((16, 16, 3), 128, np.uint8)).save(buf, format="JPEG")
    jpeg = np.frombuffer(buf.getvalue(), dtype=np.uint8)

    @pipeline_def(batch_size=1, num_threads=1, device_id=0, prefetch_queue_depth=1)
    def pipe() -> object:
        return fn.decoders.image(fn.external_source(source=lambda: [jpeg]), device="mixed")

    p = pipe()
    p.build()
    (out,) = p.run()
    assert out.as_cpu().as_array().shape == (1, 16, 16, 3)


def shadowed_packages() -> list[str]:
    """Top-level packages of .gpu/site that the interpreter also finds elsewhere."""
    site = next((Path(p) for p in sys.path if p.endswith(".gpu/site")), None)
    if site is None or not site.is_dir():
        return []
    rest = [p for p in sys.path if not p.endswith(".gpu/site")]
    names = sorted(
        e.name.removesuffix(".py")
        for e in site.iterdir()
        if e.name != "nvidia" and not e.name.endswith((".dist-info", ".libs", ".data"))
    )
    return [n for n in names if importlib.machinery.PathFinder.find_spec(n, rest) is not None]


def main() -> int:
    print("python", sys.version.split()[0], sys.executable)
    shadowed = shadowed_packages()
    print(f".gpu/site packages the image has too: {', '.join(shadowed) if shadowed else 'none'}")
    try:
        import torch
    except ImportError as exc:
        print(f"torch is not importable ({exc}): the GPU steps need the image's torch")
        dali_report()
        return 1
    print("torch", torch.__version__, "cuda", torch.version.cuda, "from", torch.__file__)
    print("devices", torch.cuda.device_count())
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        print(f"  cuda:{i} {p.name} cc {p.major}.{p.minor} {p.total_memory / 2**30:.0f} GiB")
    dali_report()
    if not torch.cuda.is_available():
        print("torch sees no CUDA device", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
