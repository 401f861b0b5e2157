#!/usr/bin/env python3
"""Import circles between the files of a Rust crate's src/ (issue 30: every import points down).

An edge goes from a file to the file that defines each name it uses through `crate::`,
`super::` or `self::` paths (`use` lines and paths in code); `pub use` re-exports are followed
to the defining file and are not uses themselves. Prints each strongly connected component of
more than one file with its edges, and exits with status 1 if there is any.
    python3 scripts/import_cycles.py src [-v]      # -v: every file's edges
"""
import os, re, sys
root = sys.argv[1] if len(sys.argv) > 1 else "src"
files = {}
for d, _, fs in os.walk(root):
    for f in fs:
        if f.endswith(".rs"):
            p = os.path.join(d, f)
            rel = os.path.relpath(p, root)[:-3]
            parts = rel.split(os.sep)
            if parts[-1] == "mod" or parts[-1] == "lib":
                parts = parts[:-1]
            files[tuple(parts)] = p
src = {k: open(v).read() for k, v in files.items()}
def strip_comments(s):
    s = re.sub(r"//[^\n]*", "", s)
    return re.sub(r"/\*.*?\*/", "", s, flags=re.S)
code = {k: strip_comments(v) for k, v in src.items()}
# inline modules declared in a file (mod x { ... }) are treated as part of the file
def inline_mods(k):
    return set(re.findall(r"\bmod\s+(\w+)\s*\{", code[k]))
DEF = re.compile(r"\b(?:pub(?:\([^)]*\))?\s+)?(?:unsafe\s+)?(?:extern\s+\"C\"\s+)?(?:const\s+fn|fn|struct|enum|trait|type|const|static|union|macro_rules!)\s+(\w+)")
defs = {k: set(DEF.findall(code[k])) for k in code}
for k in code:
    defs[k] |= set(re.findall(r"macro_rules!\s*(\w+)", code[k]))
def reexports(k):
    out = {}
    for m in re.finditer(r"\bpub(?:\([^)]*\))?\s+use\s+([^;]+);", code[k]):
        for path, name in expand(m.group(1)):
            out[name] = path
    return out
def expand(t, prefix=""):
    t = t.strip()
    res = []
    m = re.match(r"^(.*?)\{(.*)\}$", t, re.S)
    if m:
        pre = prefix + m.group(1)
        depth, cur, items = 0, "", []
        for ch in m.group(2):
            if ch == "{": depth += 1
            if ch == "}": depth -= 1
            if ch == "," and depth == 0:
                items.append(cur); cur = ""
            else:
                cur += ch
        items.append(cur)
        for it in items:
            if it.strip():
                res += expand(it, pre)
        return res
    full = (prefix + t).replace(" ", "").replace("\n", "")
    if " as " in (prefix + t):
        full = (prefix + t).split(" as ")[0].replace(" ", "").replace("\n", "")
        name = (prefix + t).split(" as ")[1].strip()
    else:
        name = full.split("::")[-1]
    if name == "self":
        full = full[: -len("::self")]
        name = full.split("::")[-1]
    return [(full, name)]
rex = {k: reexports(k) for k in code}
def absolute(k, path):
    segs = path.split("::")
    if segs[0] == "crate":
        base = []; segs = segs[1:]
    elif segs[0] in ("super", "self"):
        is_mod = files[k].endswith("mod.rs") or files[k].endswith("lib.rs")
        base = list(k) if is_mod else list(k[:-1])
        if segs[0] == "self":
            base = list(k); segs = segs[1:]
            if not is_mod:
                base = list(k)
        while segs and segs[0] == "super":
            base = base[:-1] if is_mod or base != list(k) else base[:-1]
            segs = segs[1:]
        if path.startswith("super"):
            # super of a non-mod file k=(a,b) is module (a,)
            n = path.split("::").count("super")
            base = list(k[:-n]) if len(k) >= n else []
            segs = [s for s in path.split("::") if s != "super"]
    else:
        return None
    return base, segs
def resolve(k, path, depth=0):
    a = absolute(k, path)
    if a is None or depth > 10:
        return None
    base, segs = a
    mod = list(base)
    i = 0
    while i < len(segs) and tuple(mod + [segs[i]]) in files:
        mod.append(segs[i]); i += 1
    mk = tuple(mod)
    if mk not in files:
        return None
    if i >= len(segs):
        return mk
    name = segs[i]
    if name in defs[mk] or name in inline_mods(mk):
        return mk
    if name in rex[mk]:
        r = resolve(mk, rex[mk][name], depth + 1)
        return r or mk
    return mk
edges = {k: set() for k in code}
for k, c in code.items():
    paths = []
    for m in re.finditer(r"\buse\s+([^;]+);", c):
        if re.search(r"\bpub(?:\([^)]*\))?\s+use\s+" + re.escape(m.group(1)) , c):
            continue  # re-exports are not uses
        paths += [p for p, _ in expand(m.group(1))]
    body = re.sub(r"\bpub(?:\([^)]*\))?\s+use\s+[^;]+;", "", c)
    paths += re.findall(r"\b((?:crate|super)(?:::\w+)+)", body)
    for p in paths:
        r = resolve(k, p)
        if r and r != k:
            edges[k].add(r)
# Tarjan
idx, low, on, st, comps, n = {}, {}, set(), [], [], [0]
sys.setrecursionlimit(10000)
def sc(v):
    idx[v] = low[v] = n[0]; n[0] += 1; st.append(v); on.add(v)
    for w in edges[v]:
        if w not in idx:
            sc(w); low[v] = min(low[v], low[w])
        elif w in on:
            low[v] = min(low[v], idx[w])
    if low[v] == idx[v]:
        comp = []
        while True:
            w = st.pop(); on.discard(w); comp.append(w)
            if w == v: break
        comps.append(comp)
for v in edges:
    if v not in idx: sc(v)
name = lambda k: "/".join(k) or "lib"
bad = [c for c in comps if len(c) > 1]
for c in bad:
    print(f"circle of {len(c)}: " + ", ".join(sorted(name(x) for x in c)))
    cs = set(c)
    for x in sorted(c):
        print("   ", name(x), "->", ", ".join(sorted(name(y) for y in edges[x] if y in cs)))
if "-v" in sys.argv:
    for k in sorted(edges): print(name(k), "->", ", ".join(sorted(name(y) for y in edges[k])))
print(f"{len(bad)} circles")
sys.exit(1 if bad else 0)
