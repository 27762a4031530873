#!/usr/bin/env python3
"""Speed benchmark for task-checkpoint-mcp: every tool call against its physical floor.

The benchmark generates deterministic (seeded) workspaces, drives the real
server over stdio (one long-lived process per workspace, exactly as an MCP
client does) and times each tool call on the client side. In the same run it
measures the floors of the same work on the same files:

  stat walk     a recursive os.scandir walk that stats every file
  hash all      reading and sha256-hashing every file
  copy all      shutil.copyfile of every file into a scratch directory
  hash + copy all + os.sync
                reading and sha256-hashing every file, copying every file into
                a scratch directory, then one os.sync() that flushes the copies
  copy all twice + os.sync
                copying every file into two scratch directories, then one
                os.sync() that flushes the copies
  hash changed  reading and sha256-hashing only the files an operation changed
  diff changed  reading each changed text file and its stored version, and
                difflib.unified_diff of the two (what a diff adds to a plan)
  git snapshot  `git add -A` + `git write-tree` with a temporary GIT_INDEX_FILE;
                for a save after a change, git's next snapshot of that change
                (its index kept from the snapshot before), timed before the
                save, with new objects going to a scratch object directory
                (the repository's own objects read as an alternate), so git
                writes the same new blobs and trees the save has to write

Each floor runs once to warm the page cache and is then measured (median of
several runs); dirty pages are flushed with os.sync() before every timed floor
and every timed tool call, so neither side pays for the other's writes.

Every row prints the call's milliseconds, its floor, ratio = ms / floor and
target = the issue's budget / floor, so a row passes when ratio <= target; a
row whose floor is under 5 ms has an allowance of 3 ms on top (it passes when
ms <= target x floor + 3 ms, and its target reads "+3 ms").
Budgets: save with no change and resume 3x walk; save or capture after a
change and restore preview 3x walk + 1.5x hash changed; a restore preview with
diff that plus 1.5x diff changed (reading both sides of each changed text file
and difflib's unified diff of them, in this process); restore
apply, and a paths restore of one file (its row beside the whole tree's, from
the same state), 3x walk + 2x copy changed; init and export 1.5x (hash + copy all + os.sync); import
1.5x (copy all twice + os.sync); first save 1.5x copy all; a save in a git
repository the same save without git (the medium run) + 1.5x git's snapshot;
an idle watcher tick 2x walk. The run ends with how many of its timed rows
met their targets ("targets met: N of M", also in --json as targets_met and
targets). Also reported: the server's peak
memory (VmHWM, target under 64 MB), the store's size over the workspace's,
and the CPU an idle watcher burns with TC_WATCH_INTERVAL=1, with change
events (the default on Linux) and polling (TC_WATCH_EVENTS=off, as on other
platforms).

Workspaces: small (~300 files, 3 MB of source-like text in nested
directories), medium (~1,500 files, 80 MB of text and incompressible binary
with one 20 MB file), git (medium as a git repository with one commit and
uncommitted edits) and, with --size full, large (10,000 files, ~400 MB).

Usage:
  python3 tools/bench.py                 quick run (small, medium, git)
  python3 tools/bench.py --size full     adds the large workspace
  python3 tools/bench.py --json out.json writes every raw number
  python3 tools/bench.py --quick-idle    5 s instead of 20 s idle-watcher window

Standard library only; not part of the unit suite.
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVER = os.path.join(REPO, "scripts", "tc_mcp.py")

SKIP_NAMES = (".checkpoints", ".git", ".task-checkpoint-store.json")
CHUNK = 1 << 20
CALL_TIMEOUT = 900.0
MEMORY_TARGET_MB = 64.0
# The server re-reads files changed within about a second of its last snapshot
# ("racily clean"); setup edits are followed by this pause before the next timed call.
RACY_PAUSE = 1.1

# The floors of init and export (which read, hash and store every file) and of
# import (which writes every file twice, into the store and the workspace).
INIT_FLOOR = "hash + copy all + os.sync"
IMPORT_FLOOR = "copy all twice + os.sync"

# The budgets, as printed in the legend.
TARGET_SAVE_CLEAN = "3x walk"
TARGET_CHANGE = "3x walk + 1.5x hash changed"
TARGET_APPLY = "3x walk + 2x copy changed"
TARGET_DIFF = "3x walk + 1.5x hash changed + 1.5x diff changed"
TARGET_COPY = "1.5x copy all"
TARGET_INIT = "1.5x (%s)" % INIT_FLOOR
TARGET_IMPORT = "1.5x (%s)" % IMPORT_FLOOR
TARGET_GIT = "save + 1.5x git snapshot"
TARGET_IDLE = "2x walk"
# Under a floor this short a call's fixed costs (the round trip, a flush) outweigh
# the files: such a row passes up to its budget plus the allowance.
SMALL_FLOOR_MS = 5.0
ALLOWANCE_MS = 3.0

WORDS = (
    "alpha beta gamma delta parser lexer buffer render widget model view router cache "
    "queue worker engine schema loader writer reader format codec stream layout theme "
    "icon sprite mesh shader audio vector matrix graph node edge index search query "
    "table record field event signal handler module plugin driver socket packet frame "
    "client server bridge adapter filter mapper reducer state action effect hook util "
    "helper common core base shared config report metric timer batch chunk slice panel "
    "dialog button label input output kernel thread pool task job pipeline stage"
).split()
TOP_DIRS = ("src", "lib", "docs", "tests", "assets", "app", "pkg", "web", "internal", "cmd")
TEXT_EXTS = (".py", ".js", ".ts", ".go", ".rs", ".c", ".h", ".md", ".txt", ".json", ".yaml",
             ".css", ".html", ".java")
BINARY_EXTS = (".png", ".jpg", ".bin", ".dat", ".woff2", ".gz", ".pdf", ".sqlite")

MB = 1024 * 1024

# name: (text files, text bytes, binary files, binary bytes, [big file sizes])
SPECS = {
    "small": (300, 3 * MB, 0, 0, []),
    "medium": (1199, 15 * MB, 300, 45 * MB, [20 * MB]),
    "large": (8498, 100 * MB, 1500, 240 * MB, [30 * MB, 30 * MB]),
}


class BenchError(Exception):
    pass


# ---------------------------------------------------------------------------
# Deterministic workspaces
# ---------------------------------------------------------------------------

def line_pool(rng, count=4000):
    tails = ("", ":", ";", " {", " }", ")", ",", " = 0", " += 1", " -> None:", " # note")
    pool = []
    for _ in range(count):
        indent = "    " * rng.randrange(0, 4)
        words = [rng.choice(WORDS) for _ in range(rng.randrange(2, 11))]
        style = rng.randrange(5)
        if style == 0:
            text = "def %s_%s(%s)" % (words[0], words[1], ", ".join(words[2:]))
        elif style == 1:
            text = "%s = %s(%d)" % ("_".join(words[:2]), ".".join(words[2:]) or "x",
                                    rng.randrange(10000))
        elif style == 2:
            text = "// " + " ".join(words)
        else:
            text = " ".join(words)
        pool.append(indent + text + rng.choice(tails))
    return pool


def text_bytes(rng, pool, size, header=""):
    parts = [header] if header else []
    have = len(header)
    while have < size:
        batch = rng.choices(pool, k=max(8, (size - have) // 36 + 8))
        chunk = "\n".join(batch) + "\n"
        parts.append(chunk)
        have += len(chunk)
    data = "".join(parts).encode("utf-8")[:size]
    if size and not data.endswith(b"\n"):
        data = data[:-1] + b"\n"
    return data


def spread(rng, count, total, sigma):
    """count sizes with a lognormal spread that add up to about total bytes."""
    if count == 0:
        return []
    weights = [rng.lognormvariate(0.0, sigma) for _ in range(count)]
    scale = total / sum(weights)
    return [max(64, int(w * scale)) for w in weights]


def make_dirs(rng, count):
    dirs = list(TOP_DIRS)
    seen = set(dirs)
    while len(dirs) < count:
        parent = rng.choice(dirs)
        if parent.count("/") >= 5:
            continue
        child = parent + "/" + rng.choice(WORDS)
        if child not in seen:
            seen.add(child)
            dirs.append(child)
    return [""] + dirs


class Workspace:
    """A generated workspace: its root and what each file is (text or binary)."""

    def __init__(self, name, root, seed):
        self.name = name
        self.root = root
        self.seed = seed
        self.kinds = {}  # rel -> "t" | "b"
        self.fixed = set()  # files never picked for an edit (the ignore rules)
        self.pool = line_pool(random.Random("%s-pool" % seed))
        self.edits = 0

    def full(self, rel):
        return os.path.join(self.root, *rel.split("/"))

    def files(self):
        return sorted(self.kinds)

    def write(self, rel, data):
        path = self.full(rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as fh:
            fh.write(data)

    def content(self, rng, rel, size):
        if self.kinds[rel] == "b":
            return rng.randbytes(size)
        return text_bytes(rng, self.pool, size, header="# %s\n" % rel)

    def rng(self, tag):
        self.edits += 1
        return random.Random("%s-%s-%d" % (self.seed, tag, self.edits))

    def change(self, rels, tag="edit"):
        """Rewrite each file with new content of the same size."""
        rng = self.rng(tag)
        for rel in rels:
            size = os.path.getsize(self.full(rel))
            self.write(rel, self.content(rng, rel, size))

    def touch(self, rel):
        os.utime(self.full(rel), None)

    def pick(self, count, tag="pick"):
        rng = self.rng(tag)
        free = [rel for rel in self.files() if rel not in self.fixed]
        return sorted(rng.sample(free, min(count, len(free))))

    def add(self, count, tag="add"):
        rng = self.rng(tag)
        out = []
        for i in range(count):
            rel = "src/new_%s_%d%s" % (rng.choice(WORDS), i, rng.choice(TEXT_EXTS))
            self.kinds[rel] = "t"
            self.write(rel, self.content(rng, rel, rng.randrange(500, 20000)))
            out.append(rel)
        return out

    def delete(self, rels):
        for rel in rels:
            os.unlink(self.full(rel))
            self.kinds.pop(rel, None)


def generate(name, root, seed):
    text_count, text_total, bin_count, bin_total, bigs = SPECS[name]
    rng = random.Random("%s-%s" % (seed, name))
    ws = Workspace(name, root, seed)
    os.makedirs(root, exist_ok=True)
    dirs = make_dirs(rng, max(12, (text_count + bin_count) // 9))
    plan = ([("t", s) for s in spread(rng, text_count, text_total, 1.0)]
            + [("b", s) for s in spread(rng, bin_count, bin_total, 1.2)]
            + [("b", s) for s in bigs])
    for number, (kind, size) in enumerate(plan):
        directory = rng.choice(dirs)
        if kind == "b" and size >= 10 * MB:
            directory = "assets"
        ext = rng.choice(TEXT_EXTS if kind == "t" else BINARY_EXTS)
        base = "%s_%s_%d%s" % (rng.choice(WORDS), rng.choice(WORDS), number, ext)
        rel = directory + "/" + base if directory else base
        ws.kinds[rel] = kind
        ws.write(rel, ws.content(rng, rel, size))
    return ws


def add_ignore_rules(ws):
    """Give a workspace what a real repository has: a .gitignore at the top
    and one deeper (both tracked, so recorded), and build output, logs and
    a cache they ignore (never recorded). Returns how many files are ignored."""
    rng = ws.rng("ignore")
    ws.kinds[".gitignore"] = "t"
    ws.write(".gitignore", b"build/\n*.log\n!keep.log\n.cache/\n/local-*\n")
    ws.kinds["src/.gitignore"] = "t"
    ws.write("src/.gitignore", b"*.tmp\ngenerated/\n")
    ignored = (["build/obj/%s_%d.o" % (rng.choice(WORDS), i) for i in range(120)]
               + ["logs/run_%d.log" % i for i in range(20)]
               + [".cache/%02x/entry" % i for i in range(40)]
               + ["src/generated/table_%d.py" % i for i in range(20)]
               + ["src/scratch_%d.tmp" % i for i in range(5)] + ["local-notes.txt"])
    for rel in ignored:
        ws.write(rel, rng.randbytes(rng.randrange(200, 4000)))
    ws.kinds["logs/keep.log"] = "t"  # re-included by the negation: recorded
    ws.write("logs/keep.log", b"kept\n")
    ws.fixed.update((".gitignore", "src/.gitignore", "logs/keep.log"))
    return len(ignored)


# ---------------------------------------------------------------------------
# Floors
# ---------------------------------------------------------------------------

def walk_stat(root):
    """Recursive os.scandir walk that stats every file; returns the file count."""
    count = 0
    stack = [root]
    while stack:
        directory = stack.pop()
        with os.scandir(directory) as it:
            for entry in it:
                if entry.name in SKIP_NAMES:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                else:
                    entry.stat(follow_symlinks=False)
                    count += 1
    return count


def list_files(root):
    out = []
    stack = [root]
    while stack:
        directory = stack.pop()
        with os.scandir(directory) as it:
            for entry in it:
                if entry.name in SKIP_NAMES:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                elif entry.is_file(follow_symlinks=False):
                    out.append((entry.path, entry.stat(follow_symlinks=False).st_size))
    return sorted(out)


def hash_paths(paths):
    for path in paths:
        digest = hashlib.sha256()
        with open(path, "rb") as fh:
            while True:
                block = fh.read(CHUNK)
                if not block:
                    break
                digest.update(block)
        digest.hexdigest()


def copy_paths(paths, dest):
    os.makedirs(dest, exist_ok=True)
    for number, path in enumerate(paths):
        shutil.copyfile(path, os.path.join(dest, "%06d" % number))


def tree_bytes(root, skip=SKIP_NAMES):
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip]
        for name in filenames:
            if name in skip:
                continue
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total


def sync():
    if hasattr(os, "sync"):
        os.sync()


def remove_tree(path):
    """Flush first: unlinking files whose pages are still being written back is slow."""
    sync()
    shutil.rmtree(path, ignore_errors=True)


def measure(fn, repeats, *, warm=True, after=None):
    """Median milliseconds of fn over repeats runs (after one warm-up run)."""
    if warm:
        fn()
        if after:
            after()
    samples = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1000.0)
        if after:
            after()
    return statistics.median(samples), samples


def git_env(home):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GIT_", "TC_"))}
    env.update({"GIT_CONFIG_NOSYSTEM": "1", "HOME": home, "LC_ALL": "C",
                "GIT_AUTHOR_NAME": "Bench", "GIT_AUTHOR_EMAIL": "bench@example.com",
                "GIT_COMMITTER_NAME": "Bench", "GIT_COMMITTER_EMAIL": "bench@example.com"})
    return env


def run_git(root, args, env, extra_env=None):
    full_env = dict(env)
    if extra_env:
        full_env.update(extra_env)
    proc = subprocess.run(["git", *args], cwd=root, env=full_env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if proc.returncode != 0:
        raise BenchError("git %s failed: %s" % (" ".join(args),
                                                proc.stderr.decode("utf-8", "replace")))
    return proc.stdout


def git_snapshot(root, env, index_path, seed_index, objects=None):
    """git add -A + git write-tree into a temporary index (the user's is untouched).

    With `objects`, new objects go to that directory and the repository's
    objects are only read, as an alternate: the repository gains nothing,
    so a later save still has to write the same objects.
    """
    if seed_index is not None:
        for leftover in (index_path, index_path + ".lock"):
            if os.path.exists(leftover):
                os.unlink(leftover)
    if seed_index:
        shutil.copyfile(os.path.join(root, ".git", "index"), index_path)
    extra = {"GIT_INDEX_FILE": index_path}
    if objects:
        os.makedirs(objects, exist_ok=True)
        extra.update({"GIT_OBJECT_DIRECTORY": objects,
                      "GIT_ALTERNATE_OBJECT_DIRECTORIES": os.path.join(root, ".git", "objects")})
    run_git(root, ["add", "-A"], env, extra)
    return run_git(root, ["write-tree"], env, extra).strip()


# ---------------------------------------------------------------------------
# The server, spoken to over stdio
# ---------------------------------------------------------------------------

def compile_server_modules():
    """Bring the server's compiled modules up to date, as installing the
    package does: the servers run with PYTHONDONTWRITEBYTECODE, and one
    that compiled its sources at every start would count that time and
    memory (about 0.15 s and 17 MB) in its first call and its peak."""
    import py_compile
    for name in ("tc.py", "tc_mcp.py"):
        try:
            py_compile.compile(os.path.join(REPO, "scripts", name), doraise=True)
        except (OSError, py_compile.PyCompileError) as exc:
            print("note: could not compile %s (%s); its servers compile it at start"
                  % (name, exc), file=sys.stderr)


def server_env(extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TC_", "GIT_"))}
    env.update({"TC_WATCH": "off", "TC_GIT": "off", "PYTHONDONTWRITEBYTECODE": "1"})
    env.update(extra or {})
    return env


class Server:
    def __init__(self, command, env_extra, cwd, log_path):
        self.log_path = log_path
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, env=server_env(env_extra), cwd=cwd)
        self.pid = self.proc.pid
        self._id = 0
        reply, _ms = self.request("initialize", {
            "protocolVersion": "2025-06-18", "capabilities": {},
            "clientInfo": {"name": "bench", "version": "0"}})
        if "result" not in reply:
            raise BenchError("initialize failed: %r" % reply)
        self._send({"jsonrpc": "2.0", "method": "notifications/initialized"})

    def _send(self, message):
        self.proc.stdin.write((json.dumps(message) + "\n").encode("utf-8"))
        self.proc.stdin.flush()

    def request(self, method, params=None):
        self._id += 1
        message = {"jsonrpc": "2.0", "id": self._id, "method": method}
        if params is not None:
            message["params"] = params
        data = (json.dumps(message) + "\n").encode("utf-8")
        timer = threading.Timer(CALL_TIMEOUT, self.proc.kill)
        timer.start()
        try:
            start = time.perf_counter()
            self.proc.stdin.write(data)
            self.proc.stdin.flush()
            while True:
                raw = self.proc.stdout.readline()
                if not raw:
                    raise BenchError("the server exited during %s (log: %s)"
                                     % (method, self.log_path))
                reply = json.loads(raw.decode("utf-8"))
                if reply.get("id") == self._id:
                    break
            elapsed = (time.perf_counter() - start) * 1000.0
        finally:
            timer.cancel()
        return reply, elapsed

    def tool(self, tool, /, **arguments):
        """(structured result, milliseconds); raises BenchError on any failure."""
        sync()
        reply, elapsed = self.request("tools/call", {"name": tool, "arguments": arguments})
        if "error" in reply:
            raise BenchError("%s: JSON-RPC error %r" % (tool, reply["error"]))
        result = reply["result"]
        if result.get("isError"):
            raise BenchError("%s failed: %s" % (tool, result["content"][0]["text"]))
        return result["structuredContent"], elapsed

    def status_kb(self, field):
        try:
            with open("/proc/%d/status" % self.pid) as fh:
                for line in fh:
                    if line.startswith(field + ":"):
                        return int(line.split()[1])
        except (OSError, ValueError):
            return None
        return None

    def cpu_seconds(self):
        try:
            with open("/proc/%d/stat" % self.pid) as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError, AttributeError):
            return None

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        try:
            self.proc.stdout.close()
        except OSError:
            pass
        self._log.close()


def children_cpu():
    try:
        import resource
    except ImportError:
        return None
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


# ---------------------------------------------------------------------------
# One workspace run
# ---------------------------------------------------------------------------

class Run:
    """Collects rows and raw numbers for one workspace."""

    def __init__(self, bench, ws):
        self.bench = bench
        self.ws = ws
        self.rows = []
        self.raw = {"workspace": ws.name, "calls": {}, "floors": {}, "notes": []}
        self.scratch = os.path.join(bench.workdir, "scratch-" + ws.name)
        self.scratch_count = 0

    def note(self, text):
        self.raw["notes"].append(text)

    # -- floors ---------------------------------------------------------------

    def floor(self, key, fn, repeats, after=None):
        median, samples = measure(fn, repeats, after=after)
        self.raw["floors"][key] = {"ms": median, "samples": samples}
        return median

    def base_floors(self, twin=None, imports=True):
        """Walk, hash all, copy all and init's floor, plus import's floor if imports.

        A twin (a workspace of the same files) lends its floors that copy every
        file instead of measuring them again.
        """
        files = list_files(self.ws.root)
        paths = [p for p, _s in files]
        self.raw["files"] = len(files)
        self.raw["bytes"] = sum(s for _p, s in files)
        reps = self.bench.repeats
        self.walk = self.floor("stat walk", lambda: walk_stat(self.ws.root), max(7, reps))
        self.hash_all = self.floor("hash all", lambda: hash_paths(paths), reps)
        if twin is not None:
            self.copy_all, self.init_floor = twin.copy_all, twin.init_floor
            for key in ("copy all", INIT_FLOOR):
                self.raw["floors"][key] = {"ms": twin.raw["floors"][key]["ms"], "samples": [],
                                           "from": twin.ws.name}
            return
        self.copy_all = self.copy_floor(paths)
        self.init_floor = self.copies_floor(INIT_FLOOR, paths, 1, hashed=True)
        if imports:
            self.import_floor = self.copies_floor(IMPORT_FLOOR, paths, 2, hashed=False)

    def copy_floor(self, paths):
        """copy all, and copy all + one os.sync() from the same runs."""
        copy_paths(paths, self.scratch_dir("copy"))  # warm-up run
        plain, synced = [], []
        for _ in range(self.bench.copy_repeats):
            dest = self.scratch_dir("copy")
            sync()
            start = time.perf_counter()
            copy_paths(paths, dest)
            copied = time.perf_counter()
            sync()
            done = time.perf_counter()
            plain.append((copied - start) * 1000.0)
            synced.append((done - start) * 1000.0)
        self.raw["floors"]["copy all"] = {"ms": statistics.median(plain), "samples": plain}
        self.raw["floors"]["copy all + os.sync"] = {"ms": statistics.median(synced),
                                                    "samples": synced}
        return statistics.median(plain)

    def copies_floor(self, key, paths, copies, hashed):
        """Hash every file if hashed, copy every file into `copies` new directories,
        then one os.sync(); each run's copies are deleted after it, untimed."""
        made = []

        def work():
            if hashed:
                hash_paths(paths)
            for _ in range(copies):
                made.append(self.scratch_dir("copies"))
                copy_paths(paths, made[-1])
            sync()

        def clean():
            while made:
                remove_tree(made.pop())

        return self.floor(key, work, self.bench.repeats, after=clean)

    def scratch_dir(self, tag):
        """A new directory under this run's scratch area (deleted after the run)."""
        self.scratch_count += 1
        return os.path.join(self.scratch, "%s-%d" % (tag, self.scratch_count))

    def hash_changed(self, key, rels):
        paths = [self.ws.full(r) for r in rels if os.path.isfile(self.ws.full(r))]
        return self.floor("hash changed: " + key, lambda: hash_paths(paths), self.bench.repeats)

    def copy_changed(self, key, rels):
        paths = [self.ws.full(r) for r in rels if os.path.isfile(self.ws.full(r))]
        return self.floor("copy changed: " + key,
                          lambda: copy_paths(paths, self.scratch_dir("copy-changed")),
                          self.bench.repeats)

    # -- rows -----------------------------------------------------------------

    def row(self, op, ms, floor_name, floor_ms, budget_ms, target_text):
        """budget_ms None: information only. Under a floor of SMALL_FLOOR_MS the
        row passes up to budget_ms + ALLOWANCE_MS (its allowance_ms)."""
        small = budget_ms is not None and floor_ms is not None and floor_ms < SMALL_FLOOR_MS
        row = {"workspace": self.ws.name, "operation": op, "ms": ms, "floor": floor_name,
               "floor_ms": floor_ms, "target": target_text, "budget_ms": budget_ms,
               "allowance_ms": ALLOWANCE_MS if small else 0.0}
        row["ratio"] = ms / floor_ms if ms is not None and floor_ms else None
        row["target_ratio"] = (budget_ms / floor_ms if budget_ms is not None and floor_ms
                               else None)
        if ms is None:
            row["verdict"] = "error"
        elif budget_ms is None:
            row["verdict"] = "info"
        else:
            row["verdict"] = "PASS" if ms <= budget_ms + row["allowance_ms"] else "over"
        self.rows.append(row)
        return row

    def error_row(self, op, exc):
        self.note("%s: %s" % (op, exc))
        self.rows.append({"workspace": self.ws.name, "operation": op, "ms": None,
                          "floor": "-", "floor_ms": None, "ratio": None, "target_ratio": None,
                          "target": "-", "budget_ms": None, "allowance_ms": 0.0,
                          "verdict": "error", "error": str(exc)})

    def change_row(self, op, ms, rels, key):
        hashed = self.hash_changed(key, rels)
        floor = self.walk + hashed
        return self.row(op, ms, "walk + hash %d changed" % len(rels), floor,
                        3 * self.walk + 1.5 * hashed, TARGET_CHANGE)

    # -- the sequence -----------------------------------------------------------

    def start_server(self, env_extra, tag):
        log = os.path.join(self.bench.workdir, "server-%s-%s.log" % (self.ws.name, tag))
        return Server(self.bench.command, env_extra, self.bench.workdir, log)

    def run(self, env_extra=None, git_floors=None):
        reps = self.bench.repeats
        ws = self.ws
        root = ws.root
        n = len(ws.kinds)
        one_pct = max(1, round(n * 0.01))
        srv = self.start_server(env_extra, "main")
        try:
            self._sequence(srv, root, n, one_pct, reps, git_floors)
        finally:
            self.raw["vmhwm_kb"] = srv.status_kb("VmHWM")
            srv.close()
        self.raw["store_bytes_end"] = tree_bytes(os.path.join(root, ".checkpoints"), skip=())
        self.raw["workspace_bytes_end"] = tree_bytes(root)

    def _call(self, srv, op, tool, /, **arguments):
        try:
            result, ms = srv.tool(tool, **arguments)
        except BenchError as exc:
            self.error_row(op, exc)
            return None, None
        self.raw["calls"].setdefault(op, []).append(ms)
        self._memory(srv, op)
        return result, ms

    def _memory(self, srv, op):
        """Remember the operation that raised the server's memory high-water mark."""
        hwm = srv.status_kb("VmHWM")
        if hwm is None:
            return
        growth = self.raw.setdefault("hwm_after_kb", {})
        growth[op] = hwm

    def _repeat(self, srv, op, count, prepare, name, arguments):
        """count times: prepare(i) untimed, then the call; (median ms, results).

        arguments is a dict, or a function of the run number returning one.
        """
        samples, results = [], []
        for number in range(count):
            if prepare:
                prepare(number)
            args = arguments(number) if callable(arguments) else arguments
            try:
                result, ms = srv.tool(name, **args)
            except BenchError as exc:
                self.error_row(op, exc)
                return None, results
            samples.append(ms)
            results.append(result)
            self._memory(srv, op)
        self.raw["calls"][op] = samples
        return statistics.median(samples), results

    def _sequence(self, srv, root, n, one_pct, reps, git_floors):
        ws = self.ws
        git = git_floors is not None
        # init and the first save: the whole workspace goes into the store.
        result, ms = self._call(srv, "init", "tc_init", root=root, name="bench " + ws.name,
                                goal="measure every tool call")
        if result is None:
            return
        self.row("init", ms, INIT_FLOOR, self.init_floor, 1.5 * self.init_floor, TARGET_INIT)
        result, ms = self._call(srv, "first save", "tc_save", root=root, title="step one",
                                conclusion="baseline")
        if result is None:
            return
        self.raw["git_first_save"] = result.get("git")
        if git:
            self._git_row("first save", ms, git_floors, "first save", "fresh index")
        else:
            self.row("first save", ms, "copy all", self.copy_all, 1.5 * self.copy_all,
                     TARGET_COPY)
        self.raw["store_bytes_first_save"] = tree_bytes(os.path.join(root, ".checkpoints"),
                                                        skip=())
        # Saves with nothing changed.
        ms, _r = self._repeat(srv, "save, no change", max(5, reps), None, "tc_save",
                              {"root": root, "title": "step one", "conclusion": "baseline"})
        if ms is not None:
            if git:
                self._git_row("save, no change", ms, git_floors, "save, no change",
                              "copy of user index")
            else:
                self.row("save, no change", ms, "stat walk", self.walk, 3 * self.walk,
                         TARGET_SAVE_CLEAN)
        if not git:
            # Saves after touching one file (mtime and ctime move, content does not).
            touched = ws.pick(reps, "touch")
            ms, _r = self._repeat(srv, "save, 1 file touched", len(touched),
                                  lambda i: ws.touch(touched[i]), "tc_save",
                                  lambda i: {"root": root, "title": "touch %d" % i})
            if ms is not None:
                self.change_row("save, 1 file touched", ms, touched[-1:], "touch")
        # Saves after changing 1% of the files. In git, git's own snapshot of
        # each change is timed right after it, before the save.
        batches = [ws.pick(one_pct, "save1pct") for _ in range(reps)]
        change_floors = []

        def change(i):
            ws.change(batches[i])
            if git:
                sync()
                start = time.perf_counter()
                self.git_change_floor()
                change_floors.append((time.perf_counter() - start) * 1000.0)

        ms, _r = self._repeat(srv, "save, 1% changed", reps, change,
                              "tc_save", lambda i: {"root": root, "title": "one percent %d" % i,
                                                    "conclusion": "edited %d files"
                                                    % len(batches[i])})
        if ms is not None:
            if git:
                git_floors["the change, new objects"] = statistics.median(change_floors)
                self._git_row("save, 1% changed", ms, git_floors, "save, 1% changed",
                              "the change, new objects")
            else:
                self.change_row("save, 1%% changed (%d files)" % one_pct, ms, batches[-1],
                                "1% save")
        if git:
            return
        # Read-only calls on a clean workspace.
        ms, _r = self._repeat(srv, "resume, clean", max(5, reps), None, "tc_resume",
                              {"root": root})
        if ms is not None:
            self.row("resume, clean", ms, "stat walk", self.walk, 3 * self.walk,
                     TARGET_SAVE_CLEAN)
        ms, _r = self._repeat(srv, "show (list)", max(5, reps), None, "tc_show", {"root": root})
        if ms is not None:
            self.row("show (list)", ms, "stat walk", self.walk, None, "-")
        ms, _r = self._repeat(srv, "show step 1 (files)", reps, None, "tc_show",
                              {"root": root, "index": 1})
        if ms is not None:
            self.row("show step 1 (files)", ms, "stat walk", self.walk, None, "-")
        # Resume with about 100 files changed and not recorded.
        hundred = ws.pick(min(100, n // 2), "resume100")
        ws.change(hundred, "resume100")
        ms, results = self._repeat(srv, "resume, ~100 changed", reps, None, "tc_resume",
                                   {"root": root})
        if ms is not None:
            seen = len(results[-1]["drift_paths"]) + results[-1]["omitted"].get("drift_paths", 0)
            if seen < len(hundred):
                self.note("resume listed %d drift paths for %d changed files"
                          % (seen, len(hundred)))
            self.row("resume, %d changed" % len(hundred), ms, "stat walk", self.walk,
                     3 * self.walk, TARGET_SAVE_CLEAN)
        # Record them (untimed), more than the racy margin after the edits, so the
        # captures below re-read what they changed, not these files again.
        time.sleep(RACY_PAUSE)
        try:
            srv.tool("tc_save", root=root, title="record the changed files")
        except BenchError as exc:
            self.note("setup save failed: %s" % exc)
        # Capture after a 1% change.
        batches = [ws.pick(one_pct, "capture") for _ in range(reps)]
        ms, results = self._repeat(srv, "capture, 1% changed", reps,
                                   lambda i: ws.change(batches[i]), "tc_capture",
                                   {"root": root})
        if ms is not None:
            self.raw["capture_reads"] = [r["reads"] for r in results]
            if not all(r["captured"] for r in results):
                self.note("a capture after a change recorded nothing")
            self.change_row("capture, 1%% changed (%d files)" % one_pct, ms, batches[-1],
                            "1% capture")
        # Restore: preview, apply to step 1, apply the recovered record (back).
        ms, results = self._repeat(srv, "restore preview -> step 1", reps, None, "tc_restore",
                                   {"root": root, "index": 1})
        if ms is None:
            return
        # The plan in the result lists at most 100 paths of each kind; the
        # floors need all of them, so they come from step 1's files and the
        # workspace's own content (untimed).
        preview = results[-1]
        self.raw["restore_plan"] = {k: len(v) + preview["omitted"].get("plan." + k, 0)
                                    for k, v in preview["plan"].items()}
        step1 = step_files(srv, root, 1)
        now = {rel: file_sha(ws.full(rel)) for rel in ws.files()}
        existing = sorted(rel for rel in now if step1.get(rel) != now[rel])
        written = sorted(rel for rel in step1 if now.get(rel) != step1[rel])
        planned = self.raw["restore_plan"]
        if (len(existing), len(written)) != (planned["to_replace"] + planned["to_delete"],
                                             planned["to_replace"] + planned["to_write"]):
            self.note("restore plan %s, but %d files differ from step 1 here and %d of "
                      "step 1 differ" % (planned, len(existing), len(written)))
        self.change_row("restore preview -> s1 (%d differ)" % len(existing), ms, existing,
                        "restore preview")
        self._restore_trust_rows(srv, root, reps, existing, written, step1)
        before = {rel: file_sha(ws.full(rel)) for rel in existing}
        copy_floor_rels = existing  # current versions: about the sizes a restore writes
        copied = self.copy_changed("restore apply", copy_floor_rels)
        result, ms = self._call(srv, "restore apply -> s1", "tc_restore", root=root, index=1,
                                apply=True)
        if result is None:
            return
        floor = self.walk + copied
        self.row("restore apply -> s1 (%d files)" % len(written), ms,
                 "walk + copy %d changed" % len(copy_floor_rels), floor,
                 3 * self.walk + 2 * copied, TARGET_APPLY)
        recovered = result["recovered"]
        result, ms = self._call(srv, "restore apply back", "tc_restore", root=root,
                                drift_id=recovered, apply=True)
        if result is None:
            return
        self.row("restore apply back (%s)" % recovered, ms,
                 "walk + copy %d changed" % len(copy_floor_rels), floor,
                 3 * self.walk + 2 * copied, TARGET_APPLY)
        after = {rel: file_sha(ws.full(rel)) if os.path.isfile(ws.full(rel)) else None
                 for rel in existing}
        if after != before:
            bad = sorted(r for r in existing if after[r] != before[r])
            self.note("restore there and back did not bring back %d file(s), e.g. %s"
                      % (len(bad), bad[0]))
        else:
            self.raw["restore_roundtrip"] = "verified %d files" % len(existing)
        # Export, then import into a fresh directory.
        export_to = os.path.join(self.bench.workdir, "export-" + ws.name)
        os.makedirs(export_to, exist_ok=True)
        result, ms = self._call(srv, "export", "tc_export", root=root, to=export_to)
        if result is not None:
            self.row("export", ms, INIT_FLOOR, self.init_floor, 1.5 * self.init_floor,
                     TARGET_INIT)
            fresh = os.path.join(self.bench.workdir, "import-" + ws.name)
            os.makedirs(fresh, exist_ok=True)
            package = result["path"]
            result, ms = self._call(srv, "import (fresh dir)", "tc_import", root=fresh,
                                    package=package)
            if result is not None:
                self.row("import (fresh dir)", ms, IMPORT_FLOOR, self.import_floor,
                         1.5 * self.import_floor, TARGET_IMPORT)
            self.bench.discard(export_to)
            self.bench.discard(fresh)
        # Compress: reclaim drift content (first call does the work).
        result, ms = self._call(srv, "compress", "tc_compress", root=root, keep_seconds=0,
                                minimum=1, maximum=50)
        if result is not None:
            self.raw["compress"] = result
            self.row("compress (reclaim %d)" % result["converted"], ms, "stat walk", self.walk,
                     None, "-")

    def _restore_trust_rows(self, srv, root, reps, existing, written, step1):
        """A preview with diff, and a paths restore of one file (undone
        after, untimed), so the whole-tree restore that follows starts from
        the same state."""
        ms, _r = self._repeat(srv, "restore preview + diff -> step 1", reps, None, "tc_restore",
                              {"root": root, "index": 1, "diff": True})
        if ms is not None:
            hashed = self.raw["floors"]["hash changed: restore preview"]["ms"]
            payload = os.path.join(root, ".checkpoints", "payload")
            pairs = [(self.ws.full(rel), os.path.join(payload, step1[rel][:2], step1[rel]))
                     for rel in existing if rel in step1]
            diffed = self.floor("diff changed: restore preview", lambda: diff_pairs(pairs),
                                reps)
            self.row("restore preview + diff -> s1 (%d differ)" % len(existing), ms,
                     "walk + hash + diff %d changed" % len(existing),
                     self.walk + hashed + diffed, 3 * self.walk + 1.5 * hashed + 1.5 * diffed,
                     TARGET_DIFF)
        one = next((rel for rel in written if rel in set(existing)), None)
        if one is None:
            self.note("no file differs on both sides: no paths restore row")
            return
        copied = self.copy_changed("restore 1 file", [one])
        result, ms = self._call(srv, "restore 1 file (paths) -> s1", "tc_restore", root=root,
                                index=1, paths=[one], apply=True)
        if result is None:
            return
        self.row("restore 1 file (paths) -> s1", ms, "walk + copy 1 changed",
                 self.walk + copied, 3 * self.walk + 2 * copied, TARGET_APPLY)
        try:
            srv.tool("tc_restore", root=root, drift_id=result["recovered"], apply=True)
        except BenchError as exc:
            self.note("undoing the paths restore failed: %s" % exc)

    def _git_row(self, op, ms, git_floors, same_op, floor_kind):
        """Target: the same save without git (medium run) + 1.5x git's own snapshot."""
        base = self.bench.reference_ms(same_op)
        git_ms = git_floors[floor_kind]
        if base is None:
            self.row("git: " + op, ms, "git snapshot (%s)" % floor_kind, git_ms, None, "-")
            return
        self.row("git: " + op, ms, "medium's save + git (%s)" % floor_kind,
                 base + git_ms, base + 1.5 * git_ms, TARGET_GIT)

    # -- idle watcher -------------------------------------------------------------

    def idle_watcher(self, seconds, events=True):
        """CPU per tick of a watcher with nothing to record: with change events
        (the default where the platform has them) and with plain polling
        (TC_WATCH_EVENTS=off, what every other platform gets)."""
        before_children = children_cpu()
        srv = self.start_server({"TC_WATCH": "on", "TC_WATCH_INTERVAL": "1",
                                 "TC_WATCH_EVENTS": "on" if events else "off"},
                                "idle" if events else "idle-polling")
        try:
            srv.tool("tc_capture", root=self.ws.root)  # registers the root with the watcher
            time.sleep(0.3)
            cpu0 = srv.cpu_seconds()
            start = time.monotonic()
            time.sleep(seconds)
            cpu1 = srv.cpu_seconds()
            window = time.monotonic() - start
            self.raw["idle_vmhwm_kb"] = srv.status_kb("VmHWM")
        finally:
            srv.close()
        approximate = False
        if cpu0 is None or cpu1 is None:
            after_children = children_cpu()
            if before_children is None or after_children is None:
                self.note("idle watcher CPU: not measurable on this platform")
                return
            cpu = after_children - before_children
            approximate = True
        else:
            cpu = cpu1 - cpu0
        ticks = max(1.0, (window - cpu) / 1.0)
        per_tick = cpu / ticks * 1000.0
        self.raw["idle" if events else "idle polling"] = {
            "window_s": window, "cpu_s": cpu, "ticks": ticks, "per_tick_ms": per_tick,
            "approximate": approximate}
        self.row("idle watcher tick%s: %.2f s CPU in %.0f s%s"
                 % ("" if events else ", polling", cpu, window, " ~" if approximate else ""),
                 per_tick, "stat walk", self.walk, 2 * self.walk, TARGET_IDLE)


def step_files(srv, root, index):
    """{path: sha256} of a step's files, read from tc_show a page at a time."""
    files, cursor = {}, 0
    while cursor is not None:
        shown, _ms = srv.tool("tc_show", root=root, index=index, limit=200, cursor=cursor)
        files.update((f["path"], f["sha256"]) for f in shown["steps"][0]["files"])
        cursor = shown["next_cursor"]
    return files


def diff_pairs(pairs):
    """difflib's unified diff of each (workspace file, stored copy) pair that
    is text of at most 1 MB on both sides, as a diff entry needs it."""
    for here, stored in pairs:
        texts = []
        for path in (here, stored):
            with open(path, "rb") as fh:
                data = fh.read(CHUNK + 1)
            if len(data) > CHUNK or b"\x00" in data:
                break
            try:
                texts.append(data.decode("utf-8").split("\n"))
            except UnicodeDecodeError:
                break
        if len(texts) == 2:
            list(difflib.unified_diff(texts[0], texts[1], "a", "b", n=3, lineterm=""))


def file_sha(path):
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


# ---------------------------------------------------------------------------
# The whole benchmark
# ---------------------------------------------------------------------------

class Phases:
    def __init__(self):
        self.start = self.last = time.monotonic()
        self.seconds = {}

    def mark(self, name):
        now = time.monotonic()
        self.seconds[name] = now - self.last
        self.last = now

    def total(self):
        return self.last - self.start


class Bench:
    def __init__(self, args):
        self.args = args
        self.seed = args.seed
        self.repeats = args.repeats
        self.copy_repeats = args.repeats
        self.command = ([sys.executable, SERVER] if not args.server
                        else args.server.split())
        self.runs = {}
        self.workdir = None
        self.keep = False
        self.trash = []
        self.trash_lock = threading.Lock()

    def discard(self, path):
        """Delete path later (in a batch, or while the server idles)."""
        with self.trash_lock:
            self.trash.append(path)

    def empty_trash(self):
        while True:
            with self.trash_lock:
                if not self.trash:
                    return
                path = self.trash.pop(0)
            remove_tree(path)

    def reference_ms(self, op):
        run = self.runs.get("medium")
        if not run:
            return None
        samples = run.raw["calls"].get(op)
        return statistics.median(samples) if samples else None

    def say(self, text):
        print(text, flush=True)

    def run_plain(self, name):
        phases = Phases()
        ws = generate(name, os.path.join(self.workdir, name), self.seed)
        sync()
        phases.mark("generate")
        run = Run(self, ws)
        self.runs[name] = run
        run.base_floors()
        phases.mark("floors")
        run.run()
        phases.mark("tool calls")
        self.finish(run, phases)
        return run

    def finish(self, run, phases, extra=""):
        self.discard(run.scratch)
        run.raw["phases"] = phases.seconds
        run.raw["seconds"] = phases.total()
        self.say("  %-7s %5d files %6.1f MB  %5.1f s (%s)%s" % (
            run.ws.name, run.raw["files"], run.raw["bytes"] / MB, run.raw["seconds"],
            ", ".join("%s %.1f" % kv for kv in phases.seconds.items()), extra))

    def run_git(self):
        phases = Phases()
        if not shutil.which("git"):
            self.say("  git     skipped: git is not installed")
            return None
        root = os.path.join(self.workdir, "git")
        ws = generate("medium", root, self.seed)
        ws.name = "git"
        ignored = add_ignore_rules(ws)
        env = git_env(self.workdir)
        time.sleep(1.1)  # files older than the index: no racily clean entries for git
        run_git(root, ["init", "-q", "-b", "main"], env)
        run_git(root, ["-c", "core.looseCompression=0", "add", "-A"], env)
        run_git(root, ["commit", "-q", "-m", "initial"], env)
        # Uncommitted edits: 1% modified, a few new files, two deleted.
        ws.change(ws.pick(max(1, round(len(ws.kinds) * 0.01)), "git-edit"))
        ws.add(5, "git-add")
        ws.delete(ws.pick(2, "git-del"))
        sync()
        phases.mark("generate + commit")
        self.say("  git     %d ignored files beside the tracked ones" % ignored)
        run = Run(self, ws)
        self.runs["git"] = run
        medium = self.runs.get("medium")
        run.base_floors(twin=medium, imports=False)
        index_path = os.path.join(run.scratch, "git-index")
        os.makedirs(run.scratch, exist_ok=True)
        floors = {
            "fresh index": run.floor("git add -A + write-tree (fresh index)",
                                     lambda: git_snapshot(root, env, index_path, False),
                                     self.repeats),
            "copy of user index": run.floor("git add -A + write-tree (copy of user index)",
                                            lambda: git_snapshot(root, env, index_path, True),
                                            self.repeats),
        }
        run.raw["git_floors"] = floors
        # git's snapshot of each later change: an index and an object directory
        # of its own, brought up to date here, untimed; then one snapshot per change.
        change_index = os.path.join(run.scratch, "git-change-index")
        change_objects = os.path.join(run.scratch, "git-change-objects")
        git_snapshot(root, env, change_index, True, change_objects)
        run.git_change_floor = lambda: git_snapshot(root, env, change_index, None,
                                                    change_objects)
        phases.mark("floors")
        run.run(env_extra={"TC_GIT": "on"}, git_floors=floors)
        phases.mark("tool calls")
        refs = run_git(root, ["for-each-ref", "--format=%(refname)", "refs/checkpoints/"], env)
        run.raw["git_refs"] = refs.decode().split()
        self.finish(run, phases, " %d checkpoint refs" % len(run.raw["git_refs"]))
        return run

    def main(self):
        started = time.monotonic()
        own_workdir = self.args.workdir is None
        self.keep = self.args.keep or not own_workdir
        if own_workdir:
            self.workdir = os.path.realpath(tempfile.mkdtemp(prefix="tc-bench-"))
        else:
            self.workdir = os.path.realpath(self.args.workdir)
            os.makedirs(self.workdir, exist_ok=True)
            if os.listdir(self.workdir):
                raise SystemExit("--workdir %s is not empty" % self.workdir)
        idle = 5.0 if self.args.quick_idle else 20.0
        if self.args.idle_seconds is not None:
            idle = self.args.idle_seconds
        names = ["small", "medium", "git"] + (["large"] if self.args.size == "full" else [])
        if self.args.only:
            names = [n for n in names if n in self.args.only.split(",")]
        idle_on = "large" if "large" in names else "medium"
        self.say("task-checkpoint-mcp bench: size=%s seed=%s repeats=%d workdir=%s"
                 % (self.args.size, self.seed, self.repeats, self.workdir))
        self.say("server: %s" % " ".join(self.command))
        compile_server_modules()
        try:
            for name in names:
                if name == "git":
                    run = self.run_git()
                else:
                    run = self.run_plain(name)
                if run and name != idle_on and not self.keep:
                    self.discard(run.ws.root)
            run = self.runs.get(idle_on)
            if run and idle > 0:
                # Deleting finished workspaces happens in the bench process while the
                # server idles; the measurement reads the server's own CPU time.
                cleaner = threading.Thread(target=self.empty_trash, daemon=True)
                cleaner.start()
                start = time.monotonic()
                run.idle_watcher(idle)
                run.raw["phases"]["idle watcher"] = time.monotonic() - start
                cleaner.join()
                start = time.monotonic()
                run.idle_watcher(idle / 2, events=False)
                run.raw["phases"]["idle watcher, polling"] = time.monotonic() - start
                self.say("  %-7s idle watcher measured over %.0f s (polling: %.0f s)"
                         % (idle_on, idle, idle / 2))
        finally:
            self.empty_trash()
            if not self.keep:
                remove_tree(self.workdir)
        elapsed = time.monotonic() - started
        self.report(elapsed)

    # -- output -------------------------------------------------------------------

    def report(self, elapsed):
        rows = [row for run in self.runs.values() for row in run.rows]
        self.say("")
        self.say("Floors are measured on the same files in the same run; each floor runs once "
                 "to warm the page cache, then median of %d (walk: %d); os.sync() before "
                 "every timed floor and tool call." % (self.repeats, max(7, self.repeats)))
        self.say("Tool calls: client-side time of one tools/call round trip, median of %d "
                 "where repeated (no-change saves and clean resumes: %d). Idle watcher: the "
                 "server's own CPU time (/proc) per tick with TC_WATCH_INTERVAL=1, with "
                 "change events and polling (TC_WATCH_EVENTS=off)."
                 % (self.repeats, max(5, self.repeats)))
        self.say("ratio = ms / floor ms; target = the issue's budget / floor ms "
                 "(budgets: %s)." % "; ".join(sorted({r["target"] for r in rows
                                                       if r["target"] != "-"})))
        self.say("A row whose floor is under %.0f ms passes when ms <= target x floor ms + "
                 "%.0f ms (its target reads +%.0f ms)."
                 % (SMALL_FLOOR_MS, ALLOWANCE_MS, ALLOWANCE_MS))
        self.say("")
        header = "%-7s %-44s %9s  %-44s %9s %7s %12s  %s" % (
            "ws", "operation", "ms", "floor", "floor ms", "ratio", "target", "result")
        self.say(header)
        self.say("-" * len(header))
        for row in rows:
            self.say("%-7s %-44s %9s  %-44s %9s %7s %12s  %s" % (
                row["workspace"], row["operation"][:44], fmt_ms(row["ms"]),
                row["floor"][:44], fmt_ms(row["floor_ms"]), fmt_ratio(row["ratio"]),
                fmt_target(row), row["verdict"]))
        self.say("")
        self.say("%-7s %8s %9s %9s %9s %9s %10s %10s %10s" % (
            "ws", "files", "MB", "walk ms", "hash ms", "copy ms", "copy+sync", "store/ws",
            "peak MB"))
        memory_rows = []
        for name, run in self.runs.items():
            raw = run.raw
            floors = raw["floors"]
            store_ratio = (raw.get("store_bytes_end", 0) / raw["workspace_bytes_end"]
                           if raw.get("workspace_bytes_end") else None)
            peak = raw.get("vmhwm_kb")
            peak_mb = peak / 1024.0 if peak else None
            memory_rows.append((name, peak_mb))
            self.say("%-7s %8d %9.1f %9s %9s %9s %10s %10s %10s" % (
                name, raw["files"], raw["bytes"] / MB, fmt_ms(floors["stat walk"]["ms"]),
                fmt_ms(floors["hash all"]["ms"]), fmt_ms(floors["copy all"]["ms"]),
                fmt_ms(floors.get("copy all + os.sync", {}).get("ms")),
                fmt_ratio(store_ratio), "%.1f" % peak_mb if peak_mb else "n/a"))
            if "git_floors" in raw:
                self.say("        git add -A + write-tree: fresh index %s ms, copy of user "
                         "index %s ms, the 1%% change with new objects %s ms; refs "
                         "written: %d; first save git: %s" % (
                             fmt_ms(raw["git_floors"]["fresh index"]),
                             fmt_ms(raw["git_floors"]["copy of user index"]),
                             fmt_ms(raw["git_floors"].get("the change, new objects")),
                             len(raw.get("git_refs", [])),
                             json.dumps(raw.get("git_first_save"))))
            if raw.get("capture_reads"):
                self.say("        capture reads per call: %s; restore plan %s; %s" % (
                    raw["capture_reads"], raw.get("restore_plan"),
                    raw.get("restore_roundtrip", "restore round trip not verified")))
            if raw.get("store_bytes_first_save") is not None and raw.get("bytes"):
                self.say("        store after first save: %.2f x workspace; at the end: %s x"
                         % (raw["store_bytes_first_save"] / raw["bytes"], fmt_ratio(store_ratio)))
            if raw.get("hwm_after_kb"):
                steps, last = [], None
                for op, kb in raw["hwm_after_kb"].items():
                    if last is not None and kb - last >= 1024:
                        steps.append("%s +%.1f" % (op, (kb - last) / 1024.0))
                    last = kb
                first_op, first_kb = next(iter(raw["hwm_after_kb"].items()))
                self.say("        peak memory after %s %.1f MB; grew during: %s" % (
                    first_op, first_kb / 1024.0, ", ".join(steps) or "nothing after that"))
            for text in raw["notes"]:
                self.say("        note: " + text)
        memory_verdicts = []
        for name, peak_mb in memory_rows:
            if peak_mb is None:
                continue
            verdict = "PASS" if peak_mb < MEMORY_TARGET_MB else "over"
            memory_verdicts.append((name, peak_mb, verdict))
        if memory_verdicts:
            self.say("peak memory (VmHWM, target < %d MB on large): %s" % (
                MEMORY_TARGET_MB, ", ".join("%s %.1f MB %s" % m for m in memory_verdicts)))
        targeted = [r for r in rows if r["verdict"] in ("PASS", "over")]
        passed = [r for r in targeted if r["verdict"] == "PASS"]
        errors = [r for r in rows if r["verdict"] == "error"]
        worst = sorted((r for r in targeted if r["verdict"] == "over"),
                       key=lambda r: r["ratio"] / r["target_ratio"], reverse=True)[:3]
        worst_text = "; ".join("%s %s %.2f (target %s)" % (
            r["workspace"], r["operation"], r["ratio"], fmt_target(r)) for r in worst)
        met = "targets met: %d of %d" % (len(passed), len(targeted))
        self.say("")
        self.say("summary: %d over, %d errors, memory %s; worst: %s; %s mode in %.0f s" % (
            len(targeted) - len(passed), len(errors),
            "/".join(v for _n, _m, v in memory_verdicts) or "n/a",
            worst_text or "none", self.args.size, elapsed))
        if self.args.json:
            doc = {"size": self.args.size, "seed": self.seed, "repeats": self.repeats,
                   "elapsed_s": elapsed, "python": sys.version.split()[0],
                   "platform": platform.platform(), "cpus": os.cpu_count(),
                   "server": self.command, "rows": rows, "targets_met": len(passed),
                   "targets": len(targeted),
                   "workspaces": {name: run.raw for name, run in self.runs.items()}}
            with open(self.args.json, "w", encoding="utf-8") as fh:
                json.dump(doc, fh, indent=1, sort_keys=True)
                fh.write("\n")
            self.say("raw numbers written to %s" % self.args.json)
        if self.args.markdown:
            with open(self.args.markdown, "w", encoding="utf-8") as fh:
                fh.write(markdown_table(rows))
            self.say("markdown table written to %s" % self.args.markdown)
        self.say(met)


def markdown_table(rows):
    """The timed rows as a Markdown table (the README's performance section)."""
    out = ["| workspace | operation | ms | floor | floor ms | ratio | target | result |",
           "|---|---|---:|---|---:|---:|---:|---|"]
    for row in rows:
        out.append("| %s | %s | %s | %s | %s | %s | %s | %s |" % (
            row["workspace"], row["operation"], fmt_ms(row.get("ms")), row.get("floor", "-"),
            fmt_ms(row.get("floor_ms")), fmt_ratio(row.get("ratio")), fmt_target(row),
            row.get("verdict", "-")))
    return "\n".join(out) + "\n"


def fmt_ms(value):
    if value is None:
        return "-"
    return "%.1f" % value if value < 1000 else "%.0f" % value


def fmt_ratio(value):
    return "-" if value is None else "%.2f" % value


def fmt_target(row):
    """The target ratio, and the allowance in ms where the row has one."""
    text = fmt_ratio(row.get("target_ratio"))
    if row.get("target_ratio") is not None and row.get("allowance_ms"):
        text += " +%.0f ms" % row["allowance_ms"]
    return text


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Time every task-checkpoint-mcp tool call against its physical floor.")
    parser.add_argument("--size", choices=("quick", "full"), default="quick",
                        help="quick: small, medium, git (default); full: adds large")
    parser.add_argument("--json", metavar="PATH", help="write the raw numbers to PATH")
    parser.add_argument("--markdown", metavar="PATH",
                        help="write the table in Markdown to PATH (as in the README)")
    parser.add_argument("--workdir", metavar="DIR",
                        help="generate workspaces here (an empty or new directory; kept)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary workdir")
    parser.add_argument("--seed", default="7", help="seed of the generated workspaces")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed runs of a repeated operation or floor (default 3)")
    parser.add_argument("--quick-idle", action="store_true",
                        help="measure the idle watcher over 5 s instead of 20 s")
    parser.add_argument("--idle-seconds", type=float, default=None,
                        help="idle watcher window in seconds (0 skips it)")
    parser.add_argument("--only", metavar="NAMES",
                        help="comma-separated subset of small,medium,git,large")
    parser.add_argument("--server", metavar="COMMAND",
                        help="server command line (default: this checkout's scripts/tc_mcp.py)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    try:
        Bench(args).main()
    except BenchError as exc:
        print("bench failed: %s" % exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
