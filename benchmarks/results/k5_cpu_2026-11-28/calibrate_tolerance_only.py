"""Qwen2.5 calibrate with 5-bit keys available: tolerance widths (no KL check), 4096 tokens, as run Z1's CPU calibration."""
import json, sys, time
from dataclasses import replace
from oscar_kv.calibrate import calibrate
from oscar_kv.calibration_settings import CalibrationSettings
from oscar_kv.models import load_model
from oscar_kv.memory import bits_per_element
name = sys.argv[1]
model, tok = load_model(name, device="cpu")
settings = replace(CalibrationSettings(), calib_tokens=4096, max_kl=None)
t0 = time.time()
rot = calibrate(model, tok, settings, progress=False)
print("calibrate s", round(time.time() - t0), flush=True)
rot.save(f"/tmp/k5cal/{name}")
print(open(f"/tmp/k5cal/{name}/manifest.json").read()[:3000])
