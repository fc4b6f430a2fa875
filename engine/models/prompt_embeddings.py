"""Text embeddings per prompt: a bounded cache in front of the text encoder, filled off the device thread when
encoding is slow.

A prompt is encoded once and its embedding (``[1, text_len, text_dim]`` float32 on the CPU) kept in an LRU
bounded both in entries and in bytes. Where the encoder is fast (on the engine's GPU: one CUDA-graph replay) a
miss is encoded where it is asked for, on the device thread, as before. Where it is slow — UMT5-XXL on the CPU
beside a GPU engine, so that its ~11 GB stay off a small card — encoding there would stall every session's
blocks for as long as one prompt takes. So with ``background`` the engine *requests* a prompt as soon as a
`start` or prompt change arrives: one worker thread encodes it, and the session is opened (or its prompt
changed) only once :meth:`ready` says so; other sessions keep streaming meanwhile::

    event loop            request(p) ──▶ [pending: at most max_pending] ──▶ worker: encode(p) ──▶ cache ──▶ on_ready()
    scheduler             ready(p)?  ── no: the session's open / prompt change waits a tick
    device thread         get(p)     ── cached (a miss — evicted meanwhile — is encoded there, as without background)

Nothing here knows sessions: the engine core decides what to request and what waits.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from engine.models.text_encoder import TextEncoder

log = logging.getLogger("arstream.text")

MAX_ENTRIES = 64
MAX_BYTES = 512 * 2**20  # 64 UMT5-XXL embeddings (512 x 4096 float32, 8 MiB each)
MAX_PENDING = 8  # prompts waiting for the worker; more is refused (the sender retries)


class EncodeQueueFull(RuntimeError):
    """Too many prompts are waiting to be encoded; the caller should refuse the request that asked for another."""


class PromptEmbeddings:
    def __init__(
        self,
        encoder: TextEncoder,
        *,
        background: bool = False,
        max_entries: int = MAX_ENTRIES,
        max_bytes: int = MAX_BYTES,
        max_pending: int = MAX_PENDING,
    ) -> None:
        if max_entries < 1 or max_bytes < 1 or max_pending < 1:
            raise ValueError("max_entries, max_bytes and max_pending must be positive")
        self.encoder = encoder
        self.max_entries, self.max_bytes, self.max_pending = max_entries, max_bytes, max_pending
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._bytes = 0
        self._pending: set[str] = set()
        self._failed: OrderedDict[str, None] = OrderedDict()  # encoded in the background and failed: get() retries
        self._lock = threading.Lock()  # the cache and the pending set (event loop, worker, device thread)
        self._encoding = threading.Lock()  # one encode at a time, whichever thread asks
        self._worker: ThreadPoolExecutor | None = None
        self.background = background
        self.encodes = 0  # encoder calls made (a hit makes none)

    @property
    def background(self) -> bool:
        return self._worker is not None

    @background.setter
    def background(self, on: bool) -> None:
        if on and self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="arstream-text")
        elif not on and self._worker is not None:
            self._worker.shutdown(wait=False, cancel_futures=True)
            self._worker = None

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._cache)

    def __contains__(self, prompt: str) -> bool:
        with self._lock:
            return prompt in self._cache

    def get(self, prompt: str) -> torch.Tensor:
        """The prompt's embedding: cached, or encoded now on the calling thread (and cached)."""
        with self._lock:
            cached = self._cache.get(prompt)
            if cached is not None:
                self._cache.move_to_end(prompt)
                return cached
            self._failed.pop(prompt, None)
        return self._encode(prompt)

    def ready(self, prompt: str) -> bool:
        """Whether :meth:`get` answers without encoding (always, without a background worker: it encodes
        where it is asked). A prompt whose background encode failed is ready too: its open is planned, and
        the encode retried there fails that session the usual way."""
        if self._worker is None:
            return True
        with self._lock:
            return prompt in self._cache or prompt in self._failed

    def request(self, prompt: str, on_ready: Callable[[], None] | None = None) -> None:
        """Have the prompt encoded in the background (nothing to do if cached or already under way);
        ``on_ready`` is called from the worker thread once it is. Raises :class:`EncodeQueueFull`."""
        if self._worker is None:
            return
        with self._lock:
            if prompt in self._cache or prompt in self._pending:
                return
            if len(self._pending) >= self.max_pending:
                raise EncodeQueueFull(f"{len(self._pending)} prompts are waiting to be encoded")
            self._pending.add(prompt)
            self._failed.pop(prompt, None)
        self._worker.submit(self._encode_in_background, prompt, on_ready)

    def close(self) -> None:
        self.background = False

    # --- internals ---------------------------------------------------------------------------------
    def _encode_in_background(self, prompt: str, on_ready: Callable[[], None] | None) -> None:
        try:
            self._encode(prompt)
        except Exception:
            log.warning("background prompt encode failed; the session's open retries it", exc_info=True)
            with self._lock:
                self._failed[prompt] = None
                while len(self._failed) > self.max_entries:
                    self._failed.popitem(last=False)
        finally:
            with self._lock:
                self._pending.discard(prompt)
            if on_ready is not None:
                on_ready()

    def _encode(self, prompt: str) -> torch.Tensor:
        with self._encoding:
            with self._lock:  # another thread may have encoded it while this one waited
                cached = self._cache.get(prompt)
            if cached is not None:
                return cached
            started = time.perf_counter()
            embedding = self.encoder.encode([prompt])
            self.encodes += 1
        # Never the prompt itself: its length and the encode's time (the CPU encoder's cost shows here).
        log.info("prompt encoded", extra={"prompt_length": len(prompt), "background": self.background,
                                          "encode_thread": threading.current_thread().name,
                                          "encode_ms": round((time.perf_counter() - started) * 1000.0, 1)})
        self._store(prompt, embedding)
        return embedding

    def _store(self, prompt: str, embedding: torch.Tensor) -> None:
        size = embedding.numel() * embedding.element_size()
        with self._lock:
            if prompt in self._cache:
                return
            self._cache[prompt] = embedding
            self._bytes += size
            # The newest entry always stays, even alone over the byte bound: a prompt being opened needs it.
            while len(self._cache) > 1 and (len(self._cache) > self.max_entries or self._bytes > self.max_bytes):
                _, evicted = self._cache.popitem(last=False)
                self._bytes -= evicted.numel() * evicted.element_size()
