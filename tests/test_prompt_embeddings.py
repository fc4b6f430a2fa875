"""Prompt embeddings: the bounded per-prompt cache, and encoding off the device thread for a slow text encoder.

The 24 GiB mode runs UMT5-XXL on the CPU, where one prompt takes a large fraction of a second or more
(docs/BENCHMARKS.md): encoded on the device thread, every session's blocks would wait for it. These tests run
the engine's tiny text encoder, behind a gate where a test must hold an encode (a stand-in for a slow one).
"""

from __future__ import annotations

import threading

import pytest
import torch

from engine.api import Engine
from engine.errors import TooManyControls
from engine.models.prompt_embeddings import EncodeQueueFull, PromptEmbeddings
from engine.models.text_encoder import TinyTextEncoder
from tests.engine_helpers import run_async as run
from tests.engine_helpers import small_config
from tests.engine_helpers import take_chunks as take

TEXT_LEN, TEXT_DIM = 16, 8
ENTRY_BYTES = TEXT_LEN * TEXT_DIM * 4  # one prompt's [1, text_len, text_dim] float32


class GatedEncoder:
    """The tiny encoder, except that prompts in ``held`` wait until the test opens the gate (or fail with
    ``fail``): the stand-in for an encode that takes long."""

    def __init__(self, encoder) -> None:
        self.encoder = encoder
        self.text_len, self.text_dim = encoder.text_len, encoder.text_dim
        self.held: set[str] = set()
        self.gate = threading.Event()
        self.fail: set[str] = set()

    def unknown_words(self, prompt: str):
        return self.encoder.unknown_words(prompt)

    def encode(self, prompts: list[str]) -> torch.Tensor:
        if prompts[0] in self.fail:
            raise RuntimeError("the encoder failed")
        if prompts[0] in self.held:
            assert self.gate.wait(60), "the test never opened the gate"
        return self.encoder.encode(prompts)


def tiny() -> TinyTextEncoder:
    return TinyTextEncoder(TEXT_DIM, TEXT_LEN, seed=3)


def test_a_prompt_is_encoded_once_and_the_cache_keeps_its_entry_and_byte_bounds():
    embeddings = PromptEmbeddings(tiny(), max_entries=3, max_bytes=10 * ENTRY_BYTES)
    first = embeddings.get("a red fox")
    assert embeddings.get("a red fox") is first and embeddings.encodes == 1  # a hit encodes nothing
    torch.testing.assert_close(first, tiny().encode(["a red fox"]), rtol=0, atol=0)
    for prompt in ("b", "c"):
        embeddings.get(prompt)
    embeddings.get("a red fox")  # used again: the newest now
    embeddings.get("d")  # over 3 entries: the least recently used ("b") goes
    assert len(embeddings) == 3 and "b" not in embeddings and "a red fox" in embeddings
    assert embeddings.nbytes == 3 * ENTRY_BYTES
    by_bytes = PromptEmbeddings(tiny(), max_entries=64, max_bytes=2 * ENTRY_BYTES + 1)
    for prompt in ("p", "q", "r"):
        by_bytes.get(prompt)
    assert len(by_bytes) == 2 and by_bytes.nbytes == 2 * ENTRY_BYTES and "p" not in by_bytes
    with pytest.raises(ValueError):
        PromptEmbeddings(tiny(), max_entries=0)


def test_background_requests_are_bounded_and_ready_once_encoded_or_failed():
    encoder = GatedEncoder(tiny())
    encoder.held = {"slow one", "slow two"}
    encoder.fail = {"broken"}
    embeddings = PromptEmbeddings(encoder, background=True, max_pending=2)
    done = threading.Semaphore(0)
    try:
        assert not embeddings.ready("slow one")
        embeddings.request("slow one", done.release)
        embeddings.request("slow one", done.release)  # already under way: no second encode, no second slot
        embeddings.request("slow two", done.release)
        with pytest.raises(EncodeQueueFull):
            embeddings.request("a third", done.release)
        assert not embeddings.ready("slow one") and not embeddings.ready("slow two")
        encoder.gate.set()
        assert done.acquire(timeout=30) and done.acquire(timeout=30)
        assert embeddings.ready("slow one") and embeddings.ready("slow two") and embeddings.encodes == 2
        embeddings.request("a third", done.release)  # room again
        assert done.acquire(timeout=30) and embeddings.ready("a third")
        # A failed encode is "ready" (the session's open is planned), and get() retries it and raises there.
        embeddings.request("broken", done.release)
        assert done.acquire(timeout=30) and embeddings.ready("broken")
        with pytest.raises(RuntimeError, match="the encoder failed"):
            embeddings.get("broken")
        assert not embeddings.ready("broken")
    finally:
        encoder.gate.set()
        embeddings.close()


def test_a_slow_prompt_encode_holds_back_only_its_own_session_and_a_second_session_hits_the_cache():
    async def scenario():
        engine = Engine(small_config(window_frames=3, text_encode_in_background=True))
        await engine.start()
        try:
            embeddings = engine.runner.pipeline.embeddings
            assert embeddings.background
            encoder = GatedEncoder(embeddings.encoder)
            embeddings.encoder = encoder
            a = engine.create_session(seed=1, pace=False).session_id
            engine.start_session(a, "a lighthouse")
            await take(engine, a, 2)

            encoder.held = {"a red fox", "a storm"}
            b = engine.create_session(seed=2, pace=False).session_id
            engine.start_session(b, "a red fox")  # its encode waits at the gate...
            await take(engine, a, 3)  # ... while the other session streams on
            b_waiting = engine.status(b).counters.chunks
            b_opened = b in engine.runner.device_sessions
            engine.set_prompt(a, "a storm")  # a prompt change waiting for its encode: a goes on as it was
            await take(engine, a, 2)
            a_prompt_while_encoding = engine.runner.device_sessions[a].open_request.prompt
            encodes_before = embeddings.encodes

            encoder.gate.set()
            await take(engine, b, 1)
            await take(engine, a, 2)
            a_prompt_after = engine.runner.device_sessions[a].open_request.prompt
            c = engine.create_session(seed=3, pace=False).session_id
            engine.start_session(c, "a red fox")  # encoded already: ready at once
            await take(engine, c, 1)
            return (b_waiting, b_opened, a_prompt_while_encoding, a_prompt_after,
                    embeddings.encodes - encodes_before)
        finally:
            encoder.gate.set()
            await engine.shutdown()

    b_waiting, b_opened, while_encoding, after, encodes = run(scenario())
    assert b_waiting == 0 and not b_opened  # nothing of b ran before its prompt was there
    assert while_encoding == "a lighthouse" and after == "a storm"
    assert encodes == 2  # "a red fox" and "a storm", once each: the third session's prompt was a hit


def test_too_many_prompts_waiting_to_be_encoded_are_refused_as_rate_limited():
    async def scenario():
        engine = Engine(small_config(text_encode_in_background=True))
        await engine.start()
        embeddings = engine.runner.pipeline.embeddings
        encoder = GatedEncoder(embeddings.encoder)
        embeddings.encoder = encoder
        encoder.held = {f"prompt {i}" for i in range(embeddings.max_pending + 1)}
        try:
            sessions = [engine.create_session(seed=i, pace=False).session_id for i in range(2)]
            engine.start_session(sessions[0], "prompt 0")
            for i in range(1, embeddings.max_pending):  # prompt changes queue encodes too
                engine.set_prompt(sessions[0], f"prompt {i}")
            with pytest.raises(TooManyControls) as refused:
                engine.start_session(sessions[1], f"prompt {embeddings.max_pending}")
            return refused.value.code, engine.status(sessions[1]).state
        finally:
            encoder.gate.set()
            await engine.shutdown()

    code, state = run(scenario())
    assert code == "rate_limited" and state == "created"  # refused, not applied: it may start again later


def test_the_random_umt5_encoder_gives_each_prompt_its_states_then_zeros():
    """The benchmarks' UMT5 (Wan's geometry there; the toy geometry here, same code): a word is a token."""
    from engine.models.random_text import UMT5_TINY, random_umt5_text_encoder

    encoder = random_umt5_text_encoder("cpu", torch.float32, text_len=TEXT_LEN, geometry=UMT5_TINY, seed=1)
    fox, storm = encoder.encode(["a red fox"]), encoder.encode(["a storm at night"])
    assert fox.shape == (1, TEXT_LEN, UMT5_TINY["d_model"]) and torch.isfinite(fox).all()
    assert fox[0, :4].abs().sum(dim=-1).min() > 0 and fox[0, 4:].abs().sum() == 0  # 3 words + </s>, then zeros
    assert storm[0, :5].abs().sum(dim=-1).min() > 0 and storm[0, 5:].abs().sum() == 0
    assert not torch.equal(fox[0, :4], storm[0, :4])
