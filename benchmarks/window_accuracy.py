"""INT2 inside sliding windows: does a layer that reads only its window in INT2 lose more than one reading the whole
sequence?

SmolLM2-135M-Instruct's weights run as a Llama (full attention) and as a Mistral with a sliding window (the two
decoders differ only there), BF16 against OSCAR INT2 with the artifact shipped for the model (the same weights, so the
same artifact), over held-out text fed through the generate() cache in chunks.  Prints, per decoder, KL(BF16 || INT2)
of the next-token distributions and their top-1 agreement at the positions past the window.

    PYTHONPATH=src python benchmarks/window_accuracy.py [--tokens 2048] [--window 512] [--chunk 256]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from transformers import MistralConfig, MistralForCausalLM

from oscar_kv.artifacts import Rotations, shipped_artifact
from oscar_kv.cache import CacheSettings, OscarCache, unprepare_model
from oscar_kv.corpus import DEFAULT_CORPUS
from oscar_kv.models import AttentionGeometry, load_model

MODEL = "smollm2-135m"


def as_mistral(llama, window: int):
    """The same weights in a Mistral decoder whose every layer attends to the last ``window`` tokens."""
    c = llama.config
    config = MistralConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                           num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                           num_key_value_heads=c.num_key_value_heads, head_dim=c.hidden_size // c.num_attention_heads,
                           max_position_embeddings=c.max_position_embeddings, rope_parameters=c.rope_parameters,
                           rms_norm_eps=c.rms_norm_eps, tie_word_embeddings=c.tie_word_embeddings,
                           sliding_window=window, attn_implementation="sdpa")
    model = MistralForCausalLM(config).eval()
    model.load_state_dict(llama.state_dict())
    return model


@torch.no_grad()
def compare(model, ids: torch.Tensor, chunk: int, start: int) -> tuple[float, float]:
    """(mean KL(BF16 || INT2), top-1 agreement) over positions >= start."""
    ref = model(ids).logits[0, start:].float()
    rot = Rotations.load(shipped_artifact(MODEL))
    rot.geometry = AttentionGeometry.of(model.config)  # the same weights under another decoder name
    cache = OscarCache(model, rot, CacheSettings("int2"))
    logits = [model(ids[:, a:a + chunk], past_key_values=cache).logits[0] for a in range(0, ids.shape[1], chunk)]
    unprepare_model(model)
    got = torch.cat(logits)[start:].float()
    kl = F.kl_div(F.log_softmax(got, -1), F.log_softmax(ref, -1), log_target=True, reduction="none").sum(-1)
    return kl.mean().item(), (got.argmax(-1) == ref.argmax(-1)).float().mean().item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=256)
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    llama, tokenizer = load_model(MODEL, "cpu", torch.float32)
    text = DEFAULT_CORPUS.read_text()
    ids = tokenizer(text[len(text) // 2:], return_tensors="pt").input_ids[:, :args.tokens]
    print(f"{MODEL}, {ids.shape[1]} tokens of {DEFAULT_CORPUS.name} (second half), positions >= {args.window} scored")
    for name, model in (("full attention (Llama)", llama), (f"window {args.window} (Mistral)", as_mistral(llama, args.window))):
        kl, top1 = compare(model, ids, args.chunk, args.window)
        print(f"{name:>28}: KL(BF16 || INT2) {kl:.4f}, top-1 agreement {top1:.3f}", flush=True)


if __name__ == "__main__":
    main()
