"""The tokenizer over HTTP in vLLM's endpoints and shapes: GET /tokenizer_info, POST /tokenize, POST /detokenize.
lm-eval-harness's remote tokenizer reads them, and vllm-router's cache-aware policy tokenizes through /tokenize."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request

from .protocol import DetokenizeRequest, RequestError, TokenizeRequest, parse_request
from .state import ServerState


def add_tokenizer_routes(app: FastAPI, state: ServerState) -> None:
    config = tokenizer_info_of(state.tokenizer, state.max_len)

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request):
        state.check_auth(request)
        return config

    @app.post("/tokenize")
    async def tokenize(request: Request):
        state.check_auth(request)
        return await asyncio.to_thread(_tokenize, state, await state.read_body(request))

    @app.post("/detokenize")
    async def detokenize(request: Request):
        state.check_auth(request)
        return await asyncio.to_thread(_detokenize, state, await state.read_body(request))


def _tokenize(state: ServerState, raw: bytes) -> dict:
    body = parse_request(TokenizeRequest, raw)
    state.check_model(body.model)
    tokenizer = state.tokenizer
    if body.messages is not None:
        text = body.chat_text(tokenizer)
        ids = tokenizer(text, add_special_tokens=bool(body.add_special_tokens)).input_ids
    else:
        add = True if body.add_special_tokens is None else body.add_special_tokens
        ids = tokenizer(body.prompt, add_special_tokens=add).input_ids
    ids = list(ids)
    return {"count": len(ids), "max_model_len": state.max_len, "tokens": ids,
            "token_strs": tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None}


def _detokenize(state: ServerState, raw: bytes) -> dict:
    body = parse_request(DetokenizeRequest, raw)
    state.check_model(body.model)
    tokenizer = state.tokenizer
    vocab = state.engine.engine.model.config.vocab_size
    if any(not 0 <= t < len(tokenizer) and not 0 <= t < vocab for t in body.tokens):
        raise RequestError(f"token ids must lie in [0, {max(vocab, len(tokenizer))})", "tokens")
    return {"prompt": tokenizer.decode(body.tokens)}


def tokenizer_info_of(tokenizer, max_model_len: int) -> dict:
    """``GET /tokenizer_info``: the tokenizer's configuration as vLLM gives it (tokenizer_config.json's fields), with
    ``model_max_length`` the server's context (what it accepts, not the tokenizer file's often huge number)."""
    info = {"tokenizer_class": type(tokenizer).__name__}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        token = getattr(tokenizer, name, None)
        info[name] = None if token is None else str(token)
    info.update(model_max_length=max_model_len, max_model_len=max_model_len, vocab_size=len(tokenizer),
                add_bos_token=getattr(tokenizer, "add_bos_token", None),
                add_eos_token=getattr(tokenizer, "add_eos_token", None),
                clean_up_tokenization_spaces=getattr(tokenizer, "clean_up_tokenization_spaces", None),
                chat_template=getattr(tokenizer, "chat_template", None))
    return info
