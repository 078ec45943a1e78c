"""Does the calibration's key logit noise predict accuracy?  Over the protocol's candidates of one model (k2, k3, k4,
the tolerance 0.1 and 0.3 allocations), the correlation of log(mean key noise over layers) with log(KL vs BF16), from
the default artifact's recorded noise per width and the protocol's results (benchmarks/NOTES.md, "Issue 34").

    PYTHONPATH=src python3 benchmarks/protocol_correlation.py
"""
import json, math
from pathlib import Path
from oscar_kv.allocation import allocate_key_widths
base = Path(__file__).parent / 'results' / 'protocol_h200_2026-11-26'
for model, ctxs, hd in (('qwen',('8192','16384','32768'),128),('smol',('4096','8192'),64)):
    man=json.load(open(base/model/'manifest_default.json'))['calibration']['widths']
    by={int(w):n for w,n in man['key_noise_by_width'].items()}
    L=len(by[2])
    res=json.load(open(base/model/'results.json'))['methods']
    cands={'oscar-k2':[2]*L,'oscar-k3':[3]*L,'oscar-k4':[4]*L,'oscar':man['k_bits'],
           'oscar-n0.3':allocate_key_widths(by,[2]*L,0.3,None,int(man['seq_len']),hd,hd).k_bits}
    for ctx in ctxs:
        pts=[]
        for name,kb in cands.items():
            noise=[by[b][i] for i,b in enumerate(kb)]
            pts.append((name, sum(noise)/L, max(noise), res[name]['kl'][ctx], res[name]['niah_multikey'][ctx]))
        xs=[math.log(p[1]) for p in pts]; ys=[math.log(p[3]) for p in pts]
        n=len(xs); mx=sum(xs)/n; my=sum(ys)/n
        r=sum((x-mx)*(y-my) for x,y in zip(xs,ys))/math.sqrt(sum((x-mx)**2 for x in xs)*sum((y-my)**2 for y in ys))
        print(model, ctx, 'r(log mean noise, log KL) = %.3f' % r, [(p[0], round(p[1],3), round(p[3],4)) for p in pts])
