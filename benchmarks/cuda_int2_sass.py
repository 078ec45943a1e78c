"""Compile the CUDA decode kernel (src/oscar_kv/kernels/int2_decode.cu) for sm_90 on a machine without a GPU, and
report registers / spills per variant, or dump its SASS (to compare a variant's machine code before and after a
change).

NVRTC comes from the ``nvidia-cuda-nvrtc`` wheel (pip download it and unzip it anywhere; no GPU, driver or CUDA
toolkit is needed), cuobjdump from the Triton wheel.  The defines are the ones int2_cuda._kernel passes, the NVRTC
options the ones torch.cuda._compile_kernel passes (its CUDA include paths aside: the kernel includes no header).

    python benchmarks/cuda_int2_sass.py --nvrtc /tmp/nvrtc/pkg/nvidia/cu13/lib/libnvrtc.so.13 [--source FILE]
        [--sass DIR]      # also write each variant's SASS to DIR/<variant>.sass
        [--kbits 2 3 4] [--dims 64 128] [--pairs 0 8 16 32] [--gqa 4]
        [--split 4x16+2]  # split key rows (quant.SplitWidth) instead of plain --kbits
        [--loop]          # the history loop's instruction count and opcode histogram (two 32-token steps)
        [--warps 2 --min-blocks 5] [--define NAME=VALUE]   # another CTA shape or budget, another define
    (--nvcc PATH compiles with a local nvcc instead of NVRTC)

To check that a change leaves a variant's machine code alone: --sass before/ on the old source (--kbits 0 for a
source that predates the KBITS define), --sass after/ on the new one, then cmp the files.  About 3 s a variant on two
cores.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLAGS = ["-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__", "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
         "-D__CUDA_NO_HALF2_OPERATORS__"]


def defines(head_dim: int, kbits: int, rope_pairs: int, min_blocks: int, gqa: int = 4, page_size: int = 16,
            sink_pages: int = 4, warps: int = 4) -> dict:
    """As int2_cuda._kernel (bfloat16 queries and outputs, no stamps, rotate-half RoPE over the whole head)."""
    d = dict(D=head_dim, P=page_size, GQA=gqa, SINK_PAGES=sink_pages, NWARPS=warps, MAX_PAGES=2048,
             MIN_BLOCKS=min_blocks, Q_KIND=1, O_KIND=1, STAMPS=0, ROPE_R=rope_pairs, ROPE_ROT=head_dim,
             ROPE_INTERLEAVED=0)
    if kbits is not None:
        d["KBITS"] = kbits
    return d


def compile_cubin(lib, source: str, arch: str = "sm_90") -> bytes:
    prog = ctypes.c_void_p()
    name = b"oscar_int2_decode"
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"k.cu", 0, None, None) == 0
    assert lib.nvrtcAddNameExpression(prog, name) == 0
    opts = [f"--gpu-architecture={arch}".encode()] + [f.encode() for f in FLAGS]
    res = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    if res != 0:
        raise RuntimeError(log.value.decode())
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
    buf = ctypes.create_string_buffer(size.value)
    assert lib.nvrtcGetCUBIN(prog, buf) == 0
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return buf.raw


def compile_nvcc(nvcc: str, source: str, arch: str = "sm_90") -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        cu, cubin = Path(tmp, "k.cu"), Path(tmp, "k.cubin")
        cu.write_text(source)
        subprocess.run([nvcc, f"-arch={arch}", "-cubin", "-o", str(cubin), *FLAGS, str(cu)], check=True)
        return cubin.read_bytes()


def history_loop(sass: str) -> tuple[int, dict[str, int]]:
    """(instructions, opcode counts) of the kernel's history loop (the `while (pos < full_end)` loop, two 32-token
    steps a turn): of the backward branches whose bodies hold tensor-core MMAs, the one with the most MMAs, leaving
    out those past the kernel's last unconditional EXIT (ptxas places the warp-divergent fallbacks of the shuffles
    there, and their branches back into the code span the loop) and a branch whose body holds another such loop
    with half its MMAs or more."""
    ins = [(int(a, 16), t.strip()) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass)]
    end = max((a for a, t in ins if t == "EXIT"), default=max((a for a, _ in ins), default=0))
    loops = []  # (first address, last address, MMAs, body)
    for a, t in ins:
        m = re.search(r"BRA\s.*?0x([0-9a-f]+)", t)
        if m and int(m.group(1), 16) < a <= end:
            lo = int(m.group(1), 16)
            body = [tt for x, tt in ins if lo <= x <= a]
            mmas = sum("HMMA" in tt for tt in body)
            if mmas:
                loops.append((lo, a, mmas, body))
    inner = [lp for lp in loops if not any(o is not lp and lp[0] <= o[0] and o[1] <= lp[1] and 2 * o[2] >= lp[2]
                                           for o in loops)]
    best = max(inner, key=lambda lp: lp[2])[3] if inner else []
    ops: dict[str, int] = {}
    for t in best:
        op = re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0]
        ops[op] = ops.get(op, 0) + 1
    return len(best), dict(sorted(ops.items(), key=lambda kv: -kv[1]))


def tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def inspect(cubin: bytes) -> tuple[str, str]:
    """(resource usage line, SASS) of a cubin: registers, stack frame bytes (spills), static shared bytes, and the
    SASS's local-memory store / load instructions (static counts)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        res = subprocess.run([tool("cuobjdump"), "--dump-resource-usage", f.name], capture_output=True,
                             text=True).stdout
        sass = subprocess.run([tool("cuobjdump"), "--dump-sass", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", res)
    stl, ldl = (len(re.findall(rf"\b{op}\b", sass)) for op in ("STL", "LDL"))  # local-memory stores, loads
    spills = f"STL {stl} LDL {ldl}"
    return (f"regs {m.group(1)} stack {m.group(2)} shared {m.group(3)} {spills}" if m else res.strip()), sass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nvrtc", help="path of libnvrtc.so (from the nvidia-cuda-nvrtc wheel)")
    ap.add_argument("--nvcc", help="compile with this nvcc instead of NVRTC")
    ap.add_argument("--split", help="split key rows at this width (e.g. 4x16+2) instead of plain --kbits")
    ap.add_argument("--loop", action="store_true", help="print the history loop's opcode histogram")
    ap.add_argument("--source", default=str(ROOT / "src/oscar_kv/kernels/int2_decode.cu"))
    ap.add_argument("--sass", help="a folder for each variant's SASS")
    ap.add_argument("--kbits", type=int, nargs="*", default=[2, 3, 4],
                    help="key widths (0: define no KBITS, for a source from before the define)")
    ap.add_argument("--dims", type=int, nargs="*", default=[64, 128])
    ap.add_argument("--pairs", type=int, nargs="*", default=[0, 8, 16, 32])
    ap.add_argument("--gqa", type=int, nargs="*", default=[4])
    ap.add_argument("--warps", type=int, default=None, help="warps per CTA (default: int2_cuda.NUM_WARPS)")
    ap.add_argument("--min-blocks", type=int, default=None, help="CTAs per SM (default: int2_cuda.min_blocks)")
    ap.add_argument("--define", action="append", default=[], help="NAME=VALUE, another define (repeatable)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT / "src"))
    from oscar_kv.kernels.int2_cuda import NUM_WARPS, min_blocks, split_defines
    from oscar_kv.quant import parse_key_width

    if bool(args.nvrtc) == bool(args.nvcc):
        ap.error("give one of --nvrtc and --nvcc")
    if args.nvrtc:
        for f in sorted(Path(args.nvrtc).parent.glob("libnvrtc-builtins.so.*")):  # NVRTC dlopens it by name
            if ".alt." not in f.name:
                ctypes.CDLL(str(f), mode=ctypes.RTLD_GLOBAL)
        lib = ctypes.CDLL(args.nvrtc)
    split = parse_key_width(args.split) if args.split else None
    text = Path(args.source).read_text()
    if args.sass:
        os.makedirs(args.sass, exist_ok=True)
    kbits = [split.bits] if split else args.kbits  # split rows: KBITS is the narrow part's width
    for d, kb, r, gqa in itertools.product(args.dims, kbits, args.pairs, args.gqa):
        mb = args.min_blocks or min_blocks(r, d, kb or 2, split=split is not None)
        nw = args.warps or NUM_WARPS
        extra = dict(zip(("SPLIT_M", "SPLIT_HB", "KTAIL"), split_defines(split))) if split else {}
        src = "".join(f"#define {k} {v}\n" for k, v in {**defines(d, kb or None, r, mb, gqa, warps=nw), **extra,
                                                            **dict(x.split("=", 1) for x in args.define)}.items()) + text
        usage, sass = inspect(compile_nvcc(args.nvcc, src) if args.nvcc else compile_cubin(lib, src))
        tag = f"D{d}_K{split or kb or 'x'}_R{r}_G{gqa}"
        print(f"{tag:18s} NWARPS {nw} MIN_BLOCKS {mb}: {usage}", flush=True)
        if args.loop:
            count, ops = history_loop(sass)
            print(f"  history loop: {count} instructions per two 32-token steps: "
                  + ", ".join(f"{op} {n}" for op, n in list(ops.items())[:16]), flush=True)
        if args.sass:
            Path(args.sass, tag + ".sass").write_text(sass)
    return 0


if __name__ == "__main__":
    sys.exit(main())
