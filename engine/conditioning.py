"""A session's text conditioning as the engine core asks for it: requested when a prompt arrives, ready or not.

Where the text encoder is slow (on the CPU beside a GPU: ``text_encode_in_background``), a prompt is encoded on
its own thread from the moment its `start` or prompt change is submitted, and the scheduler opens the session
(or changes its prompt) only once its embeddings are there, so one new prompt never stalls the device thread
that every session's blocks run on. Elsewhere everything is ready at once and the device thread encodes a
miss where it needs it, as before. The cache itself is the pipeline's (``PromptEmbeddings``).
"""

from __future__ import annotations

import asyncio
import contextlib

from engine.errors import TooManyControls
from engine.models.prompt_embeddings import EncodeQueueFull, PromptEmbeddings


class Conditioning:
    def __init__(self, embeddings: PromptEmbeddings, branch_names: tuple[str, ...]) -> None:
        self.embeddings = embeddings
        self._negative = "uncond" in branch_names  # CFG: the negative prompt is embedded too

    def request(self, prompt: str, negative_prompt: str, wake: asyncio.Event) -> None:
        """Start encoding what is not there yet; ``wake`` is set when it is (event loop only). Refused
        (``rate_limited``) while too many prompts wait for the encoder."""
        if not self.embeddings.background:
            return
        loop = asyncio.get_running_loop()

        def encoded() -> None:  # on the encoder's thread
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile (shutdown)
                loop.call_soon_threadsafe(wake.set)

        try:
            self.embeddings.request(prompt, encoded)
            if self._negative:
                self.embeddings.request(negative_prompt, encoded)
        except EncodeQueueFull:
            raise TooManyControls("too many prompts are waiting to be encoded; try again shortly") from None

    def ready(self, prompt: str, negative_prompt: str) -> bool:
        ready = self.embeddings.ready
        return ready(prompt) and (not self._negative or ready(negative_prompt))

    def close(self) -> None:
        self.embeddings.close()
