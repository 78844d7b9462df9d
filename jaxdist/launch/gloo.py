"""Gloo's connection lines, taken out of a process's output.

Gloo (XLA's CPU collectives) prints ``[Gloo] Rank 3 is connected to 7 peer ranks. Expected
number of connected peer ranks is : 7`` for every device at every start. Each device thread
writes its line in eight pieces, one ``write`` each: the four words of `WORDS`, the three
numbers after the first, second and fourth of them, and the newline. Writes of other threads,
the program's lines among them, can fall between any two pieces, so a line of the program can
hold pieces of Gloo's and end early at Gloo's newline.

`GlooFilter` takes out whole lines at once and, line by line, every word and the number that
follows it, where the number follows at once or turns up later: before the next word, or, for
the last number, at the end of the line. A program line's own digits are kept where a Gloo
number came after them; with more than 10 devices a late rank of two digits can leave one
behind (the output is one byte stream: which digit was whose cannot always be known).
"""

from __future__ import annotations

import re

WHOLE_LINE = re.compile(
    rb"\[Gloo\] Rank \d+ is connected to (\d+) peer ranks\. ?"
    rb"(?:Expected number of connected peer ranks is : \1)?(\n?)"
)
"""A connection line written without anything between its pieces."""
WORDS = re.compile(
    rb"(\[Gloo\] Rank | is connected to | peer ranks\. ?| ?Expected number of connected peer"
    rb" ranks is : )"
)
"""The words of a connection line, as its thread writes them."""
HINTS = (b"[Gloo] Rank ", b" is connected to ", b"peer ranks")
"""Substrings of which a piece of a connection line holds at least one word."""
_NUMBER = re.compile(rb"\d+")
_FORGET_AFTER = 8  # lines without a Gloo word, after which what is still owed is forgotten


def _kind(word: bytes) -> str:
    """Which of `WORDS` ``word`` is: ``rank``, ``to``, ``peers`` or ``expected``."""
    if word.startswith(b"[Gloo]"):
        return "rank"
    if word.startswith(b" is"):
        return "to"
    return "peers" if word.startswith(b" peer") else "expected"


class GlooFilter:
    """Takes Gloo's connection lines out of one stream (see the module docstring)."""

    def __init__(self) -> None:
        self.peers: bytes | None = None  # the count of peer ranks Gloo printed last
        self.owed_numbers = 0  # ranks and counts not yet seen after their words
        self.owed_newlines = 0  # newlines not yet seen of lines begun by "[Gloo] Rank "
        self.owed_last = False  # the count after "Expected number ... is : " not yet seen
        self.held: bytes | None = None  # a line kept back until the next one comes
        self._quiet = 0  # lines since the last Gloo word

    def whole_lines(self, data: bytes) -> bytes:
        """``data`` without its connection lines written whole (the first pass, per read)."""
        if b"[Gloo]" not in data:
            return data

        def drop(m: re.Match[bytes]) -> bytes:
            self.peers = m[1]
            if not m[2]:  # its newline comes after what followed it
                self.owed_newlines += 1
            return b""

        return WHOLE_LINE.sub(drop, data)

    def lines(self, line: bytes) -> list[bytes]:
        """What to copy for ``line``: the line kept back before (if any), then ``line``
        without Gloo's pieces, unless nothing of the program's is left in it or it is kept
        back: a line that ends in digits while the number of one of its Gloo words is still
        to come. If the next line starts with the following word, that number was those
        digits (written before the program's newline)."""
        out = []
        if self.held is not None:
            held, self.held = self.held, None
            first = WORDS.split(line, maxsplit=1)
            if len(first) > 1 and not first[0] and self.owed_numbers and _kind(first[1]) != "rank":
                held = self._drop_number_at_end(held, _kind(first[1]) != "to")
                self.owed_numbers -= 1
            out.append(held)
        kept, had_words = self._line(line)
        if kept is not None:
            if had_words and self.owed_numbers and kept[-1:].isdigit():
                self.held = kept
            else:
                out.append(kept)
        return out

    def release(self) -> list[bytes]:
        """The line kept back, if any (when no next line came soon)."""
        held, self.held = self.held, None
        return [] if held is None else [held]

    def _line(self, line: bytes) -> tuple[bytes | None, bool]:
        """``line`` without Gloo's pieces (None where nothing of the program's is left), and
        whether it held a Gloo word."""
        parts = WORDS.split(line)
        if len(parts) == 1:
            self._quiet += 1
            if self._quiet > _FORGET_AFTER:
                self.owed_numbers = self.owed_newlines = 0
                self.owed_last = False
            if self.owed_last and line.isdigit() and line == (self.peers or line):
                self.owed_last = False  # the last count, then Gloo's newline
                self._paid_newline()
                return None, False
            if not line and self.owed_newlines:  # Gloo's newline, after a line of the program
                self._paid_newline()
                return None, False
            return line, False
        self._quiet = 0
        kept = [parts[0]]
        for word, text in zip(parts[1::2], parts[2::2], strict=True):
            kind = _kind(word)
            if kind in ("to", "peers") and self.owed_numbers:  # a late rank or count before it
                kept[-1] = self._drop_number_at_end(kept[-1], kind == "peers")
                self.owed_numbers -= 1
            if kind == "rank":
                self.owed_newlines += 1
            if kind != "peers":  # the word's number follows it, or turns up later
                text, found = self._drop_number_at_start(text, kind != "rank")
                if found:
                    self.owed_last = self.owed_last and kind != "expected"
                elif kind == "expected":
                    self.owed_last = True
                else:
                    self.owed_numbers += 1
            kept.append(text)
        out = b"".join(kept)
        if self.owed_last and self.peers and out.endswith(self.peers):
            out, self.owed_last = out[: -len(self.peers)], False
        if out.strip():
            return out, True
        self._paid_newline()  # this line's newline was Gloo's
        return None, True

    def _paid_newline(self) -> None:
        self.owed_newlines = max(0, self.owed_newlines - 1)

    def _drop_number_at_start(self, text: bytes, count: bool) -> tuple[bytes, bool]:
        """``text`` without the rank or count (``count``) that starts it, and whether one did;
        once a count was seen, only that count is one."""
        if count and self.peers:
            return (text[len(self.peers) :], True) if text.startswith(self.peers) else (text, False)
        m = _NUMBER.match(text)
        if m is None:
            return text, False
        if count:
            self.peers = m[0]
        return text[m.end() :], True

    def _drop_number_at_end(self, text: bytes, count: bool) -> bytes:
        """``text`` without the late rank or count (``count``) written after its own digits:
        the count once seen, else one digit (every number of a job of up to 10 devices)."""
        if count and self.peers:
            return text[: -len(self.peers)] if text.endswith(self.peers) else text
        return text[:-1] if text[-1:].isdigit() else text

    @property
    def owes(self) -> bool:
        """Whether a number or newline of a connection line is still to come."""
        return bool(self.owed_numbers or self.owed_newlines or self.owed_last or self.held)
