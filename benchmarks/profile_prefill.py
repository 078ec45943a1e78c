"""Where the prefill time goes: `oscar-kv bench decode --prefill-only` under torch.profiler, the CUDA kernels
sorted by total time (one table per scheme).  Usage: python3 benchmarks/profile_prefill.py SCHEME [bench args]"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from oscar_kv.bench import decode

scheme, rest = sys.argv[1], sys.argv[2:]
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    decode.main(["--prefill-only", "--kv-cache-dtype", scheme, *rest])
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))
