"""Summarize py-spy's collapsed stacks (``py-spy record -f raw``): where a Python process spends time.

    python bench/stack_summary.py profile.txt [--within 'step \(.*engine'] [--top 30]

Prints, per function, the share of samples it is on the stack (inclusive) and on top of it (self).
"""

from __future__ import annotations

import argparse
import collections
import re


def frames_of(stack: str) -> list[str]:
    # py-spy frames read "function (file:line)"; drop the line so one function is one entry
    return [re.sub(r":\d+\)$", ")", f.strip()) for f in stack.split(";") if f.strip()]


def summarize(path: str, within: str | None, top: int) -> str:
    inclusive, self_time, total = collections.Counter(), collections.Counter(), 0
    for line in open(path):
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = frames_of(stack)
        if within and not any(re.search(within, f) for f in frames):
            continue
        n = int(count)
        total += n
        for frame in set(frames):
            inclusive[frame] += n
        if frames:
            self_time[frames[-1]] += n
    lines = [f"{total} samples" + (f" with a frame matching {within!r}" if within else "")]
    for title, counter in (("inclusive", inclusive), ("self", self_time)):
        lines.append(f"-- {title}")
        lines += [f"{n / max(total, 1):6.1%}  {frame[:150]}" for frame, n in counter.most_common(top)]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path")
    parser.add_argument("--within", default=None, help="only stacks with a frame matching this regex")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    print(summarize(args.path, args.within, args.top))


if __name__ == "__main__":
    main()
