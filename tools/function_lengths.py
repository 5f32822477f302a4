"""Lines per C++ function definition (signature to closing brace), longest first.

    python tools/function_lengths.py csrc/aten/executor.cpp csrc/aten/fused_graph.cpp
    python tools/function_lengths.py --top 10 --over 80 csrc/aten/*.cpp

Counts functions at namespace or class scope (methods defined inside a class
body included; lambdas and local classes count toward their enclosing
function). A brace-matching scan with comments and literals blanked out, not a
C++ parser: macros that open braces would confuse it (the aten sources have none).
"""
import argparse
import re
import sys


def blank_comments_and_literals(text):
    """The text with comments, string and char literals replaced by spaces (newlines kept)."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == "R" and text.startswith('R"', i):  # raw string R"delim( ... )delim"
            m = re.match(r'R"([^(\s]*)\(', text[i:])
            end = text.find(")" + m.group(1) + '"', i) if m else -1
            j = n if end < 0 else end + len(m.group(1)) + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c in "\"'":
            if c == "'" and i > 0 and (text[i - 1].isalnum()):  # a digit separator (1'000)
                out.append(" ")
                i += 1
                continue
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            out.append(c + " " * (j - i - 2) + c if j - i >= 2 else " " * (j - i))
            i = j
        elif c == "#" and (i == 0 or text[i - 1] == "\n"):  # a preprocessor line (with continuations)
            j = i
            while True:
                k = text.find("\n", j)
                if k < 0:
                    k = n
                    break
                if text[k - 1] != "\\":
                    break
                j = k + 1
            out.append(re.sub(r"[^\n]", " ", text[i:k]))
            i = k
        else:
            out.append(c)
            i += 1
    return "".join(out)


def function_name(header):
    """The name a definition's header declares (the identifier before its parameter list)."""
    depth, start = 0, None
    for k, ch in enumerate(header):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth = max(depth - 1, 0)
        elif ch == "(" and depth == 0:
            start = k
            break
    if start is None:
        return None
    m = re.search(r"(operator\s*\S+?|[~\w:]+)\s*$", header[:start])
    return m.group(1) if m else None


def functions(path):
    text = blank_comments_and_literals(open(path, encoding="utf-8").read())
    line_at = [0] * (len(text) + 1)
    line = 1
    for k, ch in enumerate(text):
        line_at[k] = line
        if ch == "\n":
            line += 1
    line_at[len(text)] = line
    stack = []  # (kind, start line, name)
    header_start = 0
    found = []
    for k, ch in enumerate(text):
        if ch == "{":
            header = text[header_start:k]
            kind = "block"
            if not stack or stack[-1][0] in ("ns", "class"):
                flat = " ".join(header.split())
                if re.search(r"\bnamespace\b", flat) or flat.startswith('extern "'):
                    kind = "ns"
                elif re.search(r"\b(class|struct|union|enum)\b", flat) and "(" not in flat.split("=")[0]:
                    kind = "class"
                elif "(" in flat and not re.search(r"=\s*\[", flat):
                    kind = "func"
            first = header_start + (len(header) - len(header.lstrip()))
            stack.append((kind, line_at[first], function_name(" ".join(header.split())) if kind == "func" else None))
            header_start = k + 1
        elif ch == "}":
            if stack:
                kind, start, name = stack.pop()
                if kind == "func":
                    found.append((line_at[k] - start + 1, start, name))
            header_start = k + 1
        elif ch == ";" and (not stack or stack[-1][0] in ("ns", "class")):
            header_start = k + 1
        elif ch == ":" and stack and stack[-1][0] == "class":
            # access specifiers (public:) end a header; a scope (::) or an initializer list does not
            before = text[header_start:k].split()
            if before and before[-1] in ("public", "private", "protected") and text[k + 1 : k + 2] != ":":
                header_start = k + 1
    return found


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--top", type=int, default=15, help="how many to list (0: all)")
    ap.add_argument("--over", type=int, default=0, help="only functions longer than this many lines")
    args = ap.parse_args()
    rows = []
    for path in args.files:
        rows += [(n, path, start, name) for n, start, name in functions(path)]
    rows.sort(key=lambda r: -r[0])
    rows = [r for r in rows if r[0] > args.over]
    if args.top:
        rows = rows[: args.top]
    for n, path, start, name in rows:
        print(f"{n:5d}  {path}:{start}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
