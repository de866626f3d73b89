"""Source handling for the emulator: rewriting of `extern __shared__`, and kernel discovery.

Kernels are found in the preprocessed source (g++ -E with __global__ turned into a marker), so
macros, #if branches and includes are taken into account the way the compiler sees them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_EXTERN_SHARED = re.compile(r"\bextern\s+[^;{}()]*?\b__shared__\b[^;{}]*?\[\s*\]\s*;")
_DROP = re.compile(r"__align__\s*\([^)]*\)|alignas\s*\([^)]*\)|__attribute__\s*\(\([^)]*\)\)|\bextern\b|\b__shared__\b")
_STATIC_SHARED = re.compile(r"\bstatic\s+(__shared__)\b")
_SHARED_DECL = re.compile(r"\b__shared__\b[^;{}]*;")
_ATTRS = re.compile(r"__align__\s*\([^)]*\)|alignas\s*\([^)]*\)|__attribute__\s*\(\([^)]*\)\)")
MARKER = "__CUDAEMU_GLOBAL__"


def mask_comments_and_strings(code: str) -> str:
    """Same-length copy of code with comments, strings and char literals blanked (newlines kept)."""
    out = list(code)
    i, n = 0, len(code)

    def blank(a: int, b: int) -> None:
        for k in range(a, b):
            if out[k] != "\n":
                out[k] = " "

    while i < n:
        c = code[i]
        if c == "/" and code.startswith("//", i):
            j = code.find("\n", i)
            j = n if j < 0 else j
            blank(i, j)
            i = j
        elif c == "/" and code.startswith("/*", i):
            j = code.find("*/", i + 2)
            j = n if j < 0 else j + 2
            blank(i, j)
            i = j
        elif c in "\"'":
            if c == "'" and i > 0 and (code[i - 1].isalnum() or code[i - 1] == "_"):
                i += 1  # digit separator (1'000) or suffix, not a literal
                continue
            j = i + 1
            while j < n and code[j] != c and code[j] != "\n":
                j += 2 if code[j] == "\\" else 1
            blank(i + 1, min(j, n))
            i = j + 1
        else:
            i += 1
    return "".join(out)


def _brace_kinds(masked: str, upto: int) -> list[tuple[str, str]]:
    """Stack of enclosing braces at position `upto`: ("ns", name) | ("linkage", "") | ("other", "")."""
    stack: list[tuple[str, str]] = []
    last = 0  # start of the current statement
    for m in re.finditer(r"[{};]", masked[:upto]):
        ch = m.group()
        if ch == "{":
            head = masked[last : m.start()]
            ns = re.search(r"\bnamespace\s*([\w:]*)\s*$", head)
            if ns:
                stack.append(("ns", ns.group(1)))
            elif re.search(r'\bextern\s*"\s*C\s*"\s*$', head) or re.search(r"\bextern\s+\s*$", head):
                stack.append(("linkage", ""))
            else:
                stack.append(("other", ""))
        elif ch == "}" and stack:
            stack.pop()
        last = m.end()
    return stack


def rewrite(code: str) -> str:
    """Rewrite what plain C++ cannot express, keeping every line where it was.

    `extern __shared__ T name[];` becomes a pointer to the launch's dynamic shared memory
    (an exactly-sized heap buffer), `static __shared__` loses the duplicate `static`.
    """
    masked = mask_comments_and_strings(code)
    pieces: list[str] = []
    pos = 0
    for m in _EXTERN_SHARED.finditer(masked):
        decl = code[m.start() : m.end()]
        body = _DROP.sub(" ", decl[: decl.rindex("[")])
        words = body.split()
        if len(words) < 2:
            continue
        name, type_ = words[-1], " ".join(words[:-1])
        in_function = any(kind == "other" for kind, _ in _brace_kinds(masked, m.start()))
        macro = "CUDAEMU_EXTERN_SHARED" if in_function else "CUDAEMU_EXTERN_SHARED_NS"
        repl = f"{macro}({type_}, {name});" + "\n" * decl.count("\n")
        pieces.append(code[pos : m.start()])
        pieces.append(repl)
        pos = m.end()
    pieces.append(code[pos:])
    out = _STATIC_SHARED.sub(r"\1", "".join(pieces))
    return _poison_static_shared(out)


def _top_level_comma(text: str) -> bool:
    depth = 0
    for ch in text:
        if ch in "<[(":
            depth += 1
        elif ch in ">])":
            depth -= 1
        elif ch == "," and depth == 0:
            return True
    return False


def _poison_static_shared(code: str) -> str:
    """Append `CUDAEMU_POISON_ONCE(name);` to function-scope `__shared__` declarations.

    The section the __shared__ macro names is poisoned at the start of every block, but g++ 12
    ignores section attributes on static locals of templates (GCC PR 88061); the first thread to
    pass such a declaration in a block poisons the variable instead.
    """
    masked = mask_comments_and_strings(code)
    pieces: list[str] = []
    pos = 0
    for m in _SHARED_DECL.finditer(masked):
        stmt_start = max(masked.rfind(c, 0, m.start()) for c in ";{}") + 1
        prefix = masked[stmt_start : m.start()]
        if "extern" in prefix or "(" in prefix or "#" in prefix:
            continue
        clean = _ATTRS.sub(" ", masked[m.start() + len("__shared__") : m.end() - 1])
        if re.search(r"[=(){}]", clean) or _top_level_comma(clean):
            continue  # initializers, several declarators: left to the section poisoning
        head = clean.split("[", 1)[0].split()
        if len(head) < 2 or not re.fullmatch(r"[A-Za-z_]\w*", head[-1]):
            continue
        if not any(kind == "other" for kind, _ in _brace_kinds(masked, m.start())):
            continue  # namespace scope: the section poisoning covers it
        pieces.append(code[pos : m.end()])
        pieces.append(f" CUDAEMU_POISON_ONCE({head[-1]});")
        pos = m.end()
    pieces.append(code[pos:])
    return "".join(pieces)


@dataclass(frozen=True)
class FoundKernel:
    name: str  # what get_function() is called with
    qualified: str  # what the launcher takes the address of


def _user_regions(preprocessed: str, emu_dir: Path) -> str:
    """Text of the preprocessed output that comes from the user's files (not system or emulator headers)."""
    keep: list[str] = []
    active = True
    emu = str(emu_dir)
    for line in preprocessed.splitlines():
        if line.startswith("# ") or line.startswith("#line"):
            mm = re.match(r'#(?:line)?\s*\d+\s+"((?:[^"\\]|\\.)*)"(.*)$', line)
            if mm:
                fname, flags = mm.group(1), mm.group(2).split()
                active = not (
                    "3" in flags or fname.startswith(emu) or fname.startswith("<") or fname.startswith("/usr/")
                )
                keep.append("\n")  # statement boundary between files
                continue
        if active:
            keep.append(line)
    return "\n".join(keep)


def find_kernels(preprocessed: str, emu_dir: Path) -> list[FoundKernel]:
    """Non-template __global__ functions at namespace scope, in order of first appearance."""
    text = _user_regions(preprocessed, emu_dir)
    masked = mask_comments_and_strings(text)
    found: dict[str, FoundKernel] = {}
    for m in re.finditer(re.escape(MARKER), masked):
        start = max(masked.rfind(";", 0, m.start()), masked.rfind("}", 0, m.start()), masked.rfind("{", 0, m.start()))
        if re.search(r"\btemplate\b", masked[start + 1 : m.start()]):
            continue
        name = _declared_name(masked, m.end())
        if not name:
            continue
        stack = _brace_kinds(masked, m.start())
        if any(kind == "other" for kind, _ in stack):
            continue
        # `::a::name` also finds names in anonymous namespaces (implicit using-directive).
        ns = "::".join(n for kind, n in stack if kind == "ns" and n)
        qualified = f"::{ns}::{name}" if ns else f"::{name}"
        found.setdefault(name, FoundKernel(name, qualified))
    return list(found.values())


def _declared_name(masked: str, pos: int) -> str | None:
    i, n = pos, len(masked)
    while i < n:
        mm = re.compile(r"\s*(__attribute__\s*\(\(|[A-Za-z_]\w*|::|\*|&|\()").match(masked, i)
        if not mm:
            return None
        tok = mm.group(1)
        if tok.startswith("__attribute__"):
            depth, j = 2, mm.end()
            while j < n and depth:
                depth += {"(": 1, ")": -1}.get(masked[j], 0)
                j += 1
            i = j
            continue
        if tok == "(":
            return None
        if tok[0].isalpha() or tok[0] == "_":
            after = re.compile(r"\s*\(").match(masked, mm.end())
            if after:
                return tok
        i = mm.end()
    return None
