"""The protocol's prompt rules, in one place: the engine, the wire schemas and the CLI all call this.

A prompt is a string of 1 to ``MAX_PROMPT_CHARS`` characters (Unicode code points, counted as sent)
that is valid Unicode and not only whitespace (``str.isspace``: spaces, tabs, newlines, and the other
Unicode White_Space characters). A negative prompt may be empty (no negative conditioning) but follows
the other rules. Over-long is its own error code (``prompt_too_long``); everything else is
``invalid_field``.
"""

from __future__ import annotations

from engine.errors import InvalidRequest, PromptTooLong

MAX_PROMPT_CHARS = 2000


def check_prompt(prompt: object, *, allow_empty: bool = False, field: str = "prompt") -> str:
    """Return ``prompt`` unchanged if it follows the rules, else raise the protocol's error.

    Messages name ``field`` and the rule, never the text (prompts stay out of logs).
    """
    if not isinstance(prompt, str):
        raise InvalidRequest(f"{field} must be a string")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise PromptTooLong(f"{field} longer than {MAX_PROMPT_CHARS} characters ({len(prompt)})")
    if not prompt:
        if allow_empty:
            return prompt
        raise InvalidRequest(f"{field} must not be empty")
    if prompt.isspace():
        raise InvalidRequest(f"{field} must not be only whitespace")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest(f"{field} is not valid Unicode (a lone surrogate)") from None
    return prompt
