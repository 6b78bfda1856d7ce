"""systemd's value syntax: word splitting, C escapes, specifiers, `$VAR` expansion, env files, time spans.

Emulates (from the man pages, behaviour checked against systemd's src/basic/extract-word.c,
escape.c and env-util.c):
* systemd.syntax(7) "Quoting": words split on whitespace, `"..."` and `'...'` group (also in the
  middle of a word), C-style escapes (`\\n \\t \\s \\xNN \\NNN \\uNNNN ...`) are decoded both outside
  and inside quotes; unknown escapes are kept literally (EXTRACT_CUNESCAPE_RELAX).
* systemd.unit(5) "Specifiers": `%n %N %p %i %I %j %f %H %l %m %b %t %S %C %L %E %T %V %h %u %U %g %G
  %s %%`; an unknown specifier is an error ("Invalid slot").
* systemd.service(5) "Command lines": `$NAME` as a whole word expands to zero or more words (the
  value is split at whitespace, quotes honoured); `${NAME}` expands inside a word to one piece;
  `$$` is a literal `$`; `${NAME:-default}` / `${NAME:+alt}` as in newer systemd.
"""

from __future__ import annotations

import os
import pwd
import re
from pathlib import Path

WHITESPACE = " \t\n\r"
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_SIMPLE_ESC = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v",
               "\\": "\\", '"': '"', "'": "'", "s": " "}


class SyntaxErr(ValueError):
    pass


def _cunescape_one(s: str, i: int) -> tuple[str, int]:
    """Decode the escape whose backslash is at s[i-1]; returns (text, next index)."""
    if i >= len(s):
        raise SyntaxErr("trailing backslash")
    c = s[i]
    if c in _SIMPLE_ESC:
        return _SIMPLE_ESC[c], i + 1
    if c == "x" and re.match(r"[0-9a-fA-F]{2}", s[i + 1:i + 3]):
        return chr(int(s[i + 1:i + 3], 16)), i + 3
    if c == "u" and re.match(r"[0-9a-fA-F]{4}", s[i + 1:i + 5]):
        return chr(int(s[i + 1:i + 5], 16)), i + 5
    if c == "U" and re.match(r"[0-9a-fA-F]{8}", s[i + 1:i + 9]):
        return chr(int(s[i + 1:i + 9], 16)), i + 9
    if c in "0123" and re.match(r"[0-7]{3}", s[i:i + 3]):
        return chr(int(s[i:i + 3], 8)), i + 3
    return "\\" + c, i + 1          # relaxed: keep an unknown escape literally


def extract_words(s: str, *, cunescape: bool = True) -> list[str]:
    """Split like extract_first_word(EXTRACT_UNQUOTE|EXTRACT_CUNESCAPE[_RELAX]) in a loop."""
    words: list[str] = []
    i, n = 0, len(s)
    while True:
        while i < n and s[i] in WHITESPACE:
            i += 1
        if i >= n:
            return words
        buf: list[str] = []
        quote = None
        while i < n:
            c = s[i]
            if quote is None and c in WHITESPACE:
                break
            if c == "\\":
                if cunescape:
                    text, i = _cunescape_one(s, i + 1)
                else:
                    if i + 1 >= n:
                        raise SyntaxErr("trailing backslash")
                    text, i = s[i + 1], i + 2
                buf.append(text)
                continue
            if quote is None and c in "'\"":
                quote = c
            elif c == quote:
                quote = None
            else:
                buf.append(c)
            i += 1
        if quote is not None:
            raise SyntaxErr("unbalanced quotes")
        words.append("".join(buf))


def resolve_specifiers(s: str, spec: dict[str, str]) -> str:
    """Replace `%x` specifiers; `%%` -> `%`. Raises SyntaxErr("Invalid slot") for unknown ones."""
    out: list[str] = []
    i = 0
    while i < len(s):
        c = s[i]
        if c != "%":
            out.append(c)
            i += 1
            continue
        if i + 1 >= len(s):
            out.append("%")     # a lone trailing % is kept
            break
        k = s[i + 1]
        if k == "%":
            out.append("%")
        elif k in spec:
            out.append(spec[k])
        else:
            raise SyntaxErr(f"Failed to resolve specifier %{k}: Invalid slot")
        i += 2
    return "".join(out)


def _lookup(name: str, env: dict[str, str]) -> str:
    return env.get(name, "")


def replace_env(word: str, env: dict[str, str]) -> str:
    """In-word expansion: `$$` -> `$`, `${NAME}`, `${NAME:-x}`, `${NAME:+x}`; bare `$NAME` is literal."""
    out: list[str] = []
    i, n = 0, len(word)
    while i < n:
        c = word[i]
        if c == "$" and word.startswith("$$", i):
            out.append("$")
            i += 2
        elif c == "$" and word.startswith("${", i):
            end = word.find("}", i + 2)
            if end < 0:
                out.append(word[i:])
                break
            body = word[i + 2:end]
            m = re.match(r"([A-Za-z_][A-Za-z0-9_]*)(?::([-+])(.*))?\Z", body, re.S)
            if not m:
                out.append(word[i:end + 1])
            elif m.group(2) == "-":
                out.append(env.get(m.group(1)) or m.group(3))
            elif m.group(2) == "+":
                out.append(m.group(3) if env.get(m.group(1)) else "")
            else:
                out.append(_lookup(m.group(1), env))
            i = end + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def expand_argv(argv: list[str], env: dict[str, str]) -> list[str]:
    """replace_env_argv(): whole-word `$NAME` splits into words; other words expand in place."""
    out: list[str] = []
    for w in argv:
        if w.startswith("$") and ENV_NAME.match(w[1:]):
            value = env.get(w[1:])
            if value:
                try:
                    out.extend(extract_words(value, cunescape=False))
                except SyntaxErr:
                    out.extend(value.split())
            continue
        out.append(replace_env(w, env))
    return out


def _unescape_name(s: str) -> str:
    out, i = [], 0
    while i < len(s):
        if s.startswith("\\x", i) and len(s) >= i + 4:
            out.append(chr(int(s[i + 2:i + 4], 16)))
            i += 4
        else:
            out.append("/" if s[i] == "-" else s[i])
            i += 1
    return "".join(out)


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def specifiers(name: str, user: str | None) -> dict[str, str]:
    """systemd.unit(5) "Specifiers" for a system-manager unit."""
    base = name.rsplit(".", 1)[0]
    prefix, _, inst = base.partition("@")
    try:
        pw = pwd.getpwnam(user or "root")
        import grp
        gname = grp.getgrgid(pw.pw_gid).gr_name
        uinfo = {"u": pw.pw_name, "U": str(pw.pw_uid), "g": gname, "G": str(pw.pw_gid),
                 "h": pw.pw_dir, "s": pw.pw_shell}
    except KeyError:
        uinfo = {"u": user or "root", "U": "", "g": "", "G": "", "h": "", "s": ""}
    host = os.uname().nodename                  # gethostname(2) is uname's nodename
    return {
        "n": name, "N": base, "p": prefix, "P": _unescape_name(prefix), "i": inst, "I": _unescape_name(inst),
        "j": prefix.rsplit("-", 1)[-1], "J": _unescape_name(prefix.rsplit("-", 1)[-1]),
        "f": "/" + _unescape_name(inst or prefix), "H": host, "l": host.split(".")[0], "q": host,
        "m": _read("/etc/machine-id"), "b": _read("/proc/sys/kernel/random/boot_id").replace("-", ""),
        "t": "/run", "S": "/var/lib", "C": "/var/cache", "L": "/var/log", "E": "/etc", "T": "/tmp",
        "V": "/var/tmp", "a": os.uname().machine.replace("_", "-"), "v": os.uname().release,
        **uinfo,
    }
