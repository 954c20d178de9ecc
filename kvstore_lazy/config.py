"""Environment variables read the way their owners read them: ps-lite's with C ``atoi``, kvstore_lazy's as on/off
words. Shared by the server runtime and the launcher so both agree on what a value means."""
from __future__ import annotations



def c_atoi(text: str) -> int:
    """C ``atoi``, as ps-lite reads its variables: leading digits after an optional sign; anything else is 0
    (so ``PS_RESEND=true`` is off for stock nodes, and must be for ours)."""
    text = text.strip()
    end = 1 if text[:1] in ("+", "-") else 0
    while end < len(text) and text[end].isdigit():
        end += 1
    try:
        return int(text[:end])
    except ValueError:
        return 0


def atoi_flag(env, name: str) -> bool:
    """A ps-lite on/off variable: atoi(value) != 0."""
    return c_atoi(env.get(name, "")) != 0


def flag(env, name: str) -> bool:
    """One of kvstore_lazy's own on/off variables: anything but empty, 0, false, no or off is on."""
    return env.get(name, "0").strip().lower() not in ("", "0", "false", "no", "off")
