"""docs/troubleshooting.md against the messages the code can emit, both ways.

The page quotes each message as the user sees it in the log: a line starting with ``>`` whose backquoted spans are
fixed fragments of the message (the parts that do not vary). Every quoted fragment must occur in a string literal
(or an f-string's or %-format's constant part) of kvstore_lazy/, so the page cannot quote a message the code no
longer says; and every message the code can log as a warning or an error, or raise as one of the user-facing
errors below, must have an entry quoting one of its fixed parts. The messages are found with ``ast``, not a regex,
so a message split over lines, implicit concatenation or an f-string counts as the user sees it.
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "troubleshooting.md"
PACKAGE = ROOT / "kvstore_lazy"
LOG_METHODS = {"error", "warning", "critical", "exception"}
# errors whose message reaches the user (the server's one line at exit, the launcher's usage error, a tool's
# "error:" line); other exceptions are bugs or are wrapped into one of these with the message kept
USER_ERRORS = {"StartupError", "ConfigError", "SnapshotError", "CheckpointError", "SchedulerLost", "LaunchError",
               "TrustError", "MembershipError", "LifecycleError", "BindError", "ConnectError", "DiskTierFailure",
               "JournalError", "FastLoadError", "KernelLoadError"}
# calls that build one of those errors: the index of the argument that is the message
BUILDERS = {"_refuse": 2}     # config._refuse(name, value, accepted) -> ConfigError(f"{name}={value!r}: {accepted}")
# fixed fragments of messages no user can meet (our own invariants, reported as errors only for tests); keep short
INTERNAL: set[str] = set()
MIN_FRAGMENT = 8
NAME = re.compile(r"\b[A-Z][A-Z0-9_]{2,}\b")
PLACEHOLDER = re.compile(r"%[-#0 +]*\d*(?:\.\d+)?[sdrfgixX%]")


@dataclass(frozen=True)
class Message:
    where: str
    what: str              # log.<level> or the error's name
    parts: tuple[str, ...]  # the fixed text between placeholders

    def __str__(self) -> str:
        return f"{self.where}: {self.what}({' … '.join(self.parts)!r})"


def constant_parts(node: ast.AST) -> list[str]:
    """The fixed text of a message expression, split where a value goes in."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return PLACEHOLDER.split(node.value)
    if isinstance(node, ast.JoinedStr):
        out, current = [], ""
        for value in node.values:
            if isinstance(value, ast.Constant):
                current += str(value.value)
            else:
                out.append(current)
                current = ""
        return out + [current]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return constant_parts(node.left) + constant_parts(node.right)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
        return constant_parts(node.left)
    return []


def distinctive(text: str) -> bool:
    """Fixed text that says something beyond a variable's name: six letters or more outside ALL_CAPS names (so
    neither ``"KVSTORE_LAZY_MEMORY_BUDGET: "`` nor ``"use "`` can stand for a message)."""
    return len(re.sub(r"[^A-Za-z]", "", NAME.sub("", text))) >= 6


def _name(func: ast.AST) -> str | None:
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def _message_of(node: ast.AST) -> tuple[str, ast.AST] | None:
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in LOG_METHODS \
            and _name(node.func.value) in ("log", "logger", "LOG") and node.args:
        return f"log.{node.func.attr}", node.args[0]
    if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
        name = _name(node.exc.func)
        index = BUILDERS.get(name or "", 0)
        if (name in USER_ERRORS or name in BUILDERS) and len(node.exc.args) > index:
            return name or "", node.exc.args[index]
        if name == "ValueError" and node.exc.args and _names_a_setting(node.exc.args[0]):
            return name, node.exc.args[0]   # a settings reader's refusal (wrapped into StartupError at start)
    return None


def _names_a_setting(message: ast.AST) -> bool:
    """The message names an environment variable: in its text, or as a ``*_ENV`` constant put into it."""
    text = "".join(constant_parts(message))
    return "KVSTORE_LAZY" in text or any(isinstance(n, ast.Name) and n.id.endswith("_ENV") for n in ast.walk(message))


def sources() -> list[tuple[str, ast.AST]]:
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 20
    return [(str(path.relative_to(ROOT)), ast.parse(path.read_text(), str(path))) for path in files]


def emitted() -> list[Message]:
    """Every warning or error the package logs, and every user-facing error it raises, with its fixed text."""
    out = []
    for where, tree in sources():
        for node in ast.walk(tree):
            found = _message_of(node)
            if found is not None:
                what, message = found
                parts = tuple(p for p in constant_parts(message) if p.strip())
                out.append(Message(f"{where}:{getattr(node, 'lineno', 0)}", what, parts))
    return out


def literals() -> list[str]:
    """The fixed parts of every string the package contains (docstrings and f-strings' constant parts too)."""
    out = []
    for _, tree in sources():
        for node in ast.walk(tree):
            if isinstance(node, (ast.Constant, ast.JoinedStr)):
                out += constant_parts(node)
    return out


def quoted() -> dict[str, str]:
    """{fragment: the entry (### heading) quoting it} from the page's ``>`` lines."""
    out: dict[str, str] = {}
    heading = ""
    for line in PAGE.read_text().splitlines():
        if line.startswith("### "):
            heading = line[4:].strip()
        elif line.startswith(">"):
            for fragment in re.findall(r"`([^`]+)`", line):
                out[fragment] = heading
    return out


def test_the_page_quotes_fragments_of_distinct_entries():
    fragments = quoted()
    assert len(fragments) > 50
    assert all(heading for heading in fragments.values()), "a quoted message before the first ### entry"
    short = [f for f in fragments if len(f) < MIN_FRAGMENT or not distinctive(f)]
    assert not short, f"fragments too short or too general to tell a message (under {MIN_FRAGMENT} characters, or " \
                      f"only a variable's name): {short}"


def test_every_quoted_fragment_is_in_the_code():
    texts = literals()
    stale = {f: entry for f, entry in quoted().items() if not any(f in text for text in texts)}
    assert not stale, ("docs/troubleshooting.md quotes text no string of kvstore_lazy/ contains (a message that "
                       f"changed or went): {stale}")


def test_every_message_the_code_emits_has_an_entry():
    messages = emitted()
    assert any(m.what == "StartupError" for m in messages) and any(m.what == "log.warning" for m in messages)
    fragments = list(quoted())
    missing = []
    for message in messages:
        if not any(distinctive(part) for part in message.parts):
            continue   # nothing fixed to quote ("%s", str(exc), "NAME: {exc}"): it passes on a message with an entry
        if any(f in part for part in message.parts for f in INTERNAL):
            continue
        if not any(f in part for part in message.parts for f in fragments):
            missing.append(str(message))
    assert not missing, "messages without an entry in docs/troubleshooting.md:\n" + "\n".join(missing)


def test_an_unquoted_message_is_found():
    """The collector sees a message in each form the code uses (so the test above can fail)."""
    tree = ast.parse('log.warning("budget %d exceeded", n)\nraise StartupError(f"cannot go: {why}; restart it")\n'
                     'raise _refuse(name, text, "use a or b")\n')
    found = [_message_of(node) for node in ast.walk(tree)]
    parts = [tuple(p for p in constant_parts(f[1]) if p.strip()) for f in found if f is not None]
    assert sorted(parts) == [("budget ", " exceeded"), ("cannot go: ", "; restart it"), ("use a or b",)]
