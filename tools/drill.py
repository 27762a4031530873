#!/usr/bin/env python3
"""End-to-end drill: the whole product, on a real workspace, in one command.

    python3 tools/drill.py            # builds, drives, checks, cleans up
    TC_DRILL_KEEP=1 python3 tools/drill.py   # keep the workspace afterwards

What it does, in a fresh temporary directory:

1. Builds a git repository with history, a second branch, a tag, a stash
   entry and uncommitted work (a staged change, an unstaged change, an
   untracked file), then makes it heavy: thousands of small files, one file
   of tens of MB, one sparse file over 100 MB, a sensitive `.env` holding a
   unique secret, and a symlink.
2. Starts the real server (`scripts/tc_mcp.py`) as a subprocess and speaks
   MCP to it over stdio: tc_init, two tc_save steps.
3. Starts a third save and kills the server with SIGKILL while that save is
   running, then starts a new server and checks the store: tc_resume,
   health, every stored payload against its hash.
4. Restores step 1 (preview, then apply), checks the files byte for byte,
   and undoes the restore through the `recovered` drift record, checking
   that the unsaved edits came back.
5. Exports a handoff package and imports it into a second workspace.
6. Checks item by item that the user's git is untouched: HEAD, branches and
   tags, the index file, status, stash, config; only refs/checkpoints/...
   was added, and `git fsck` is clean.

Every check prints PASS or FAIL with a figure (time, bytes, count). The exit
status is 1 when any check failed. The workspace is deleted at the end unless
a check failed or TC_DRILL_KEEP=1 is set; its path is printed either way.

Standard library only; not part of the unit test suite.
"""

import argparse
import hashlib
import json
import os
import queue
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVER = os.path.join(REPO, "scripts", "tc_mcp.py")
MB = 1024 * 1024
REPLY_TIMEOUT = 120


class DrillError(Exception):
    """A step of the drill could not go on."""


# ---------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------

class Report:
    def __init__(self):
        self.passed = 0
        self.failed = 0
        self.start = time.monotonic()

    def check(self, name, ok, figure=""):
        if ok:
            self.passed += 1
        else:
            self.failed += 1
        print("%s  %-52s %s" % ("PASS" if ok else "FAIL", name, figure), flush=True)
        return ok

    def note(self, text):
        print("      " + text, flush=True)

    def section(self, title):
        print("\n== %s" % title, flush=True)


def human_bytes(n):
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return "%.1f %s" % (n, unit) if unit != "B" else "%d B" % n
        n /= 1024.0
    return "%d B" % n


def listed(result, place):
    """How many entries a result's list had: the ones shown plus the ones its
    "omitted" counts (long lists are cut); place is e.g. "plan.to_write"."""
    shown = result
    for part in place.split("."):
        shown = shown[part]
    return len(shown) + result.get("omitted", {}).get(place, 0)


def seconds(t0):
    return "%.2f s" % (time.monotonic() - t0)


# ---------------------------------------------------------------------------
# A minimal MCP client over stdio
# ---------------------------------------------------------------------------

class McpServer:
    """The real server as a subprocess; one JSON-RPC message per line."""

    def __init__(self, env, cwd):
        self.proc = subprocess.Popen([sys.executable, SERVER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env=env, cwd=cwd)
        self.replies = queue.Queue()
        self.stderr = []
        self._id = 0
        threading.Thread(target=self._read_stdout, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()

    def _read_stdout(self):
        for line in iter(self.proc.stdout.readline, b""):
            try:
                self.replies.put(json.loads(line.decode("utf-8")))
            except ValueError:
                self.replies.put({"_not_json": line[:200]})
        self.replies.put(None)

    def _read_stderr(self):
        for chunk in iter(lambda: self.proc.stderr.read(4096), b""):
            self.stderr.append(chunk)

    def send(self, method, params=None, notify=False):
        msg = {"jsonrpc": "2.0", "method": method}
        if params is not None:
            msg["params"] = params
        if not notify:
            self._id += 1
            msg["id"] = self._id
        self.proc.stdin.write((json.dumps(msg) + "\n").encode("utf-8"))
        self.proc.stdin.flush()
        return msg.get("id")

    def wait_reply(self, request_id, timeout=REPLY_TIMEOUT):
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DrillError("no reply to request %s within %d s" % (request_id, timeout))
            try:
                msg = self.replies.get(timeout=remaining)
            except queue.Empty:
                continue
            if msg is None:
                raise DrillError("the server closed stdout; stderr: %s" % self.stderr_text()[-800:])
            if "_not_json" in msg:
                raise DrillError("the server wrote a non-JSON line to stdout: %r" % msg["_not_json"])
            if msg.get("id") == request_id:
                return msg

    def poll_reply(self, request_id):
        """The reply if it is already there, else None (does not block)."""
        try:
            msg = self.replies.get_nowait()
        except queue.Empty:
            return None
        if msg is not None and msg.get("id") == request_id:
            return msg
        return None

    def request(self, method, params=None):
        return self.wait_reply(self.send(method, params))

    def initialize(self):
        reply = self.request("initialize", {"protocolVersion": "2025-06-18", "capabilities": {},
                                            "clientInfo": {"name": "drill", "version": "1"}})
        self.send("notifications/initialized", notify=True)
        return reply["result"]

    def call(self, tool, **arguments):
        return tool_result(tool, self.request("tools/call", {"name": tool, "arguments": arguments}))

    def stderr_text(self):
        return b"".join(self.stderr).decode("utf-8", "replace")

    def kill(self):
        self.proc.kill()
        self.proc.wait()

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def tool_result(tool, reply):
    if "error" in reply:
        raise DrillError("%s: JSON-RPC error %s" % (tool, reply["error"]))
    result = reply["result"]
    if result.get("isError"):
        text = (result.get("content") or [{}])[0].get("text", "")
        raise DrillError("%s failed: %s" % (tool, text))
    return result["structuredContent"]


# ---------------------------------------------------------------------------
# Files and git
# ---------------------------------------------------------------------------

def write(root, rel, data):
    path = os.path.join(root, *rel.split("/"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as fh:
        fh.write(data if isinstance(data, bytes) else data.encode("utf-8"))
    return path


def read(root, rel):
    with open(os.path.join(root, *rel.split("/")), "rb") as fh:
        return fh.read()


def sha256_file(path):
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(MB), b""):
            digest.update(block)
    return digest.hexdigest()


def snapshot(root, skip=(".git", ".checkpoints")):
    """{relative path: sha256} of every regular file (symlinks not followed)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip
                       and not os.path.islink(os.path.join(dirpath, d))]
        for name in filenames:
            full = os.path.join(dirpath, name)
            if os.path.islink(full) or not os.path.isfile(full):
                continue
            out[os.path.relpath(full, root).replace(os.sep, "/")] = sha256_file(full)
    return out


def snapshot_diff(want, have, ignore=()):
    """Paths that differ between two snapshots, ignoring the given ones."""
    paths = (set(want) | set(have)) - set(ignore)
    return sorted(p for p in paths if want.get(p) != have.get(p))


def dir_bytes(path):
    total = 0
    for dirpath, _dirs, names in os.walk(path):
        for name in names:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total


def git_env():
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update({"GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull,
                "GIT_AUTHOR_NAME": "Drill User", "GIT_AUTHOR_EMAIL": "user@example.com",
                "GIT_COMMITTER_NAME": "Drill User", "GIT_COMMITTER_EMAIL": "user@example.com",
                "GIT_OPTIONAL_LOCKS": "0"})
    return env


def git(root, *args, check=True):
    proc = subprocess.run(["git", *args], cwd=root, env=git_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if check and proc.returncode != 0:
        raise DrillError("git %s failed: %s" % (" ".join(args), proc.stderr.decode().strip()))
    return proc.stdout.decode("utf-8", "replace")


def git_fingerprint(root):
    """Everything about the user's repository that the server must not change."""
    gitdir = os.path.join(root, ".git")

    def file_hash(*parts):
        path = os.path.join(gitdir, *parts)
        return sha256_file(path) if os.path.exists(path) else None

    return {
        # Read the index bytes before anything else runs git in this repo.
        "index": file_hash("index"),
        "HEAD": (git(root, "rev-parse", "HEAD").strip(),
                 git(root, "symbolic-ref", "-q", "HEAD", check=False).strip()),
        "branches and tags": git(root, "for-each-ref", "--format=%(refname) %(objectname)",
                                 "refs/heads", "refs/tags", "refs/remotes"),
        "staged changes": git(root, "diff", "--cached", "--name-status"),
        "stash": (git(root, "stash", "list"),
                  git(root, "rev-parse", "-q", "--verify", "refs/stash", check=False).strip()),
        "config": (file_hash("config"), file_hash("info", "exclude"),
                   sorted(os.listdir(os.path.join(gitdir, "hooks")))),
    }


def git_status(root):
    return git(root, "status", "--porcelain=v1", "--untracked-files=all")


# ---------------------------------------------------------------------------
# The drill
# ---------------------------------------------------------------------------

class Drill:
    def __init__(self, args, report):
        self.args = args
        self.report = report
        self.check = report.check
        self.base = os.path.realpath(tempfile.mkdtemp(prefix="tc-drill-"))
        self.root = os.path.join(self.base, "project")
        self.colleague = os.path.join(self.base, "colleague")
        self.exchange = os.path.join(self.base, "exchange")
        self.secret = ("DRILL-SECRET-" + secrets.token_hex(16)).encode()
        self.server = None
        self.task_id = None
        self.git_ok = shutil.which("git") is not None
        self.fingerprint = None
        self.save_seconds = 1.0
        self.step1 = self.step2 = self.unsaved = None
        self.step1_app = None
        self.acked_index, self.acked_snapshot = None, None
        self.head = None

    def server_env(self):
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("TC_") and not k.startswith("GIT_")}
        env.update({"TC_WATCH": "off", "TC_GIT": "on" if self.git_ok else "off",
                    "PYTHONDONTWRITEBYTECODE": "1"})
        return env

    def start_server(self):
        self.server = McpServer(self.server_env(), cwd=self.base)
        info = self.server.initialize()
        return info

    # -- 1. the workspace --------------------------------------------------

    def build_workspace(self):
        self.report.section("workspace")
        t0 = time.monotonic()
        os.makedirs(self.root)
        os.makedirs(self.exchange)
        tracked = {
            # The user's own ignore rule keeps the store out of `git status`.
            ".gitignore": ".checkpoints/\n",
            "README.md": "# Demo project\n",
            "src/app.py": "def main():\n    return 'v1'\n",
            "src/util.py": "def helper():\n    return 1\n",
            "docs/old.md": "An old page that a later step deletes.\n",
        }
        for i in range(20):
            tracked["src/pkg/mod%02d.py" % i] = "VALUE = %d\n" % i
        for rel, text in tracked.items():
            write(self.root, rel, text)
        if self.git_ok:
            git(self.root, "init", "-q", "-b", "main")
            git(self.root, "add", "-A")
            git(self.root, "commit", "-q", "-m", "initial")
            git(self.root, "branch", "feature")
            git(self.root, "tag", "v0")
            write(self.root, "README.md", "# Demo project (stashed edit)\n")
            git(self.root, "stash", "push", "-q", "-m", "work in progress")
            # Uncommitted work of every kind: staged, unstaged, untracked.
            write(self.root, "src/util.py", "def helper():\n    return 2  # staged\n")
            git(self.root, "add", "src/util.py")
            write(self.root, "src/app.py", "def main():\n    return 'v1, unstaged edit'\n")
            write(self.root, "notes/todo.txt", "untracked notes\n")

        for i in range(self.args.files):
            write(self.root, "data/gen/d%02d/f%05d.txt" % (i % 50, i),
                  "generated file %d\n%s\n" % (i, secrets.token_hex(24)))
        write(self.root, "assets/blob.bin", os.urandom(self.args.big_mb * MB))
        with open(os.path.join(self.root, "assets", "huge.img"), "wb") as fh:
            fh.truncate(self.args.sparse_mb * MB)
        write(self.root, ".env", b"API_TOKEN=" + self.secret + b"\n")
        self.symlink = False
        try:
            os.symlink(os.path.join("src", "app.py"), os.path.join(self.root, "app-link.py"))
            self.symlink = True
        except (OSError, NotImplementedError):
            self.report.note("symlinks are not available here; that part is left out")
        count = len(snapshot(self.root))
        self.check("build a heavy workspace", True,
                   "%s, %d files, %s + %s sparse" % (seconds(t0), count,
                                                     human_bytes(self.args.big_mb * MB),
                                                     human_bytes(self.args.sparse_mb * MB)))
        if self.git_ok:
            self.fingerprint = git_fingerprint(self.root)
        else:
            self.report.note("git is not installed: the git checks are left out")

    # -- 2. init and two steps ----------------------------------------------

    def first_steps(self):
        self.report.section("server, init, two steps")
        t0 = time.monotonic()
        info = self.start_server()
        self.check("server starts and answers initialize",
                   info.get("serverInfo", {}).get("name") == "task-checkpoint-mcp",
                   "%s, %s %s" % (seconds(t0), info["serverInfo"].get("name"),
                                  info["serverInfo"].get("version")))
        init = self.server.call("tc_init", root=self.root, name="Split the user module",
                                goal="Move the user module into service and repository layers",
                                constraints="Keep the public API")
        self.task_id = init["task_id"]
        self.check("tc_init", bool(self.task_id) and init["store_is_external"] is False,
                   "task_id %s" % self.task_id)

        t0 = time.monotonic()
        save = self.server.call("tc_save", root=self.root, title="Map the current module",
                                conclusion="Three entry points use the old session code",
                                next="Introduce the service layer")
        self.save_seconds = time.monotonic() - t0
        self.step1 = snapshot(self.root)
        self.step1_app = read(self.root, "src/app.py")
        store = os.path.join(self.root, ".checkpoints")
        self.check("tc_save step 1 on the heavy workspace", save["index"] == 1,
                   "%.2f s, %d files, store %s" % (self.save_seconds, len(self.step1),
                                                   human_bytes(dir_bytes(store))))
        skipped = json.dumps(save.get("skipped_paths", []))
        if self.symlink:
            self.check("the symlink is skipped and reported", "app-link.py" in skipped,
                       "%d skipped path(s)" % listed(save, "skipped_paths"))
        self.check_git_result(save, 1)
        self.check_secret_absent(store, "after step 1")
        big = [p for p in self.payload_files(store) if os.path.getsize(p) >= 100 * MB]
        self.check("the file over 100 MB is not copied into the store", not big,
                   "largest payload %s" % human_bytes(max(
                       [os.path.getsize(p) for p in self.payload_files(store)] or [0])))

        write(self.root, "src/app.py", "def main():\n    return 'v2, service layer'\n")
        write(self.root, "src/service.py", "class UserService:\n    pass\n")
        os.remove(os.path.join(self.root, "docs", "old.md"))
        write(self.root, "data/gen/d00/f00000.txt", "changed in step 2\n")
        t0 = time.monotonic()
        save = self.server.call("tc_save", root=self.root, title="Add the service layer",
                                conclusion="UserService wraps the old functions",
                                next="Switch the three views to UserService",
                                verified=["python -c 'import src.service'"])
        self.step2 = snapshot(self.root)
        self.check("tc_save step 2 (edit, add, delete)", save["index"] == 2,
                   "%s, %d changed path(s)" % (seconds(t0), len(snapshot_diff(self.step1, self.step2))))
        self.check_git_result(save, 2)
        self.acked_index, self.acked_snapshot = 2, self.step2

    def check_git_result(self, save, index):
        if not self.git_ok:
            return
        result = save.get("git") or {}
        ref = "refs/checkpoints/%s/s%04d" % (self.task_id, index)
        self.check("step %d: git ref written, repo unchanged" % index,
                   result.get("ok") is True and result.get("ref") == ref
                   and result.get("unchanged") is True,
                   "%s unchanged=%s" % (result.get("ref") or result.get("reason"),
                                        result.get("unchanged")))

    @staticmethod
    def storing(store, sha):
        """Why the save is visibly under way (the new content reaching the
        store, or a temporary file there), or None."""
        payload = os.path.join(store, "payload")
        if os.path.exists(os.path.join(payload, sha[:2], sha)):
            return "new content just stored"
        try:
            if any(name.startswith((".tmp", "tmp")) for name in os.listdir(payload)):
                return "while new content was being written"
        except OSError:
            pass
        return None

    @staticmethod
    def payload_files(store):
        out = []
        for dirpath, _dirs, names in os.walk(os.path.join(store, "payload")):
            out.extend(os.path.join(dirpath, n) for n in names)
        return out

    def check_secret_absent(self, directory, when):
        t0 = time.monotonic()
        hits, scanned = [], 0
        secret_file_sha = hashlib.sha256(read(self.root, ".env")).hexdigest()
        for dirpath, _dirs, names in os.walk(directory):
            for name in names:
                full = os.path.join(dirpath, name)
                if os.path.islink(full):
                    continue
                if name == secret_file_sha:
                    hits.append(full)
                with open(full, "rb") as fh:
                    data = fh.read()
                scanned += len(data)
                if self.secret in data:
                    hits.append(full)
        self.check("the .env secret appears nowhere (%s)" % when, not hits,
                   "%s scanned in %s%s" % (human_bytes(scanned), seconds(t0),
                                           "; found in %s" % hits[:3] if hits else ""))

    # -- 3. SIGKILL in the middle of a save ----------------------------------

    def kill_during_save(self):
        self.report.section("SIGKILL during a save, then a new server")
        store = os.path.join(self.root, ".checkpoints")
        # The kill lands when the new content is seen reaching the store; the
        # delay is only a fallback for a store laid out differently.
        delay = 1.0 + 3 * self.save_seconds
        for attempt in range(1, 4):
            new_blob = os.urandom(self.args.big_mb * MB)
            sha = hashlib.sha256(new_blob).hexdigest()
            write(self.root, "assets/blob.bin", new_blob)
            write(self.root, "src/app.py",
                  "def main():\n    return 'v3 attempt %d, not yet saved'\n" % attempt)
            write(self.root, ".env", b"API_TOKEN=" + self.secret + b"\nROTATED=%d\n" % attempt)
            t0 = time.monotonic()
            request_id = self.server.send("tools/call", {"name": "tc_save", "arguments": {
                "root": self.root, "title": "Switch the views (interrupted)",
                "conclusion": "never acknowledged", "next": "-"}})
            reply, trigger = None, "after a delay"
            while time.monotonic() - t0 < delay:
                reply = self.server.poll_reply(request_id)
                if reply is not None:
                    break
                seen = self.storing(store, sha)
                if seen:
                    trigger = seen
                    break
                time.sleep(0.001)
            reply = reply or self.server.poll_reply(request_id)
            if reply is None:
                self.server.kill()
                self.check("server killed in the middle of tc_save", True,
                           "SIGKILL %.0f ms in, %s (attempt %d)"
                           % ((time.monotonic() - t0) * 1000, trigger, attempt))
                break
            self.acked_index = tool_result("tc_save", reply)["index"]
            self.acked_snapshot = snapshot(self.root)
            self.report.note("attempt %d: the save finished before the kill; trying sooner"
                             % attempt)
            delay = 0.3 * (time.monotonic() - t0) / attempt
        else:
            self.server.kill()
            self.check("server killed in the middle of tc_save", False,
                       "every save finished before the kill could land")
        self.server = None
        self.unsaved = snapshot(self.root)

        t0 = time.monotonic()
        self.start_server()
        resume = self.server.call("tc_resume", root=self.root)
        self.head = resume["head"]
        # The killed save either left no step or a complete one, never half.
        self.check("new server: tc_resume after the kill",
                   resume["health"]["ok"] and self.head in (self.acked_index,
                                                            self.acked_index + 1),
                   "%s, head %s, health errors %d" % (seconds(t0), self.head,
                                                      len(resume["health"]["errors"])))
        for error in resume["health"]["errors"]:
            self.report.note("health: " + error)
        if self.head == self.acked_index:
            missing = {"src/app.py", "assets/blob.bin"} - set(resume["drift_paths"])
            self.check("unsaved edits listed in drift_paths", not missing,
                       "%d path(s)%s" % (listed(resume, "drift_paths"),
                                         ", missing %s" % sorted(missing) if missing else ""))
        handoff = resume.get("handoff", "")
        self.check("handoff names the task and the next step",
                   "Split the user module" in handoff
                   and (self.head != 2 or "Switch the three views to UserService" in handoff),
                   "%d lines" % len(handoff.splitlines()))
        for line in handoff.splitlines():
            self.report.note("| " + line)
        t0 = time.monotonic()
        bad = []
        payloads = self.payload_files(store)
        for path in payloads:
            name = os.path.basename(path)
            if len(name) == 64 and sha256_file(path) != name:
                bad.append(path)
        self.check("every stored payload matches its hash", not bad,
                   "%d payloads, %s, %s" % (len(payloads), human_bytes(sum(
                       os.path.getsize(p) for p in payloads)), seconds(t0)))

    # -- 4. restore and undo -------------------------------------------------

    def restore_and_undo(self):
        self.report.section("restore step 1, then undo")
        status_before = git_status(self.root) if self.git_ok else None
        before_restore = snapshot(self.root)
        t0 = time.monotonic()
        preview = self.server.call("tc_restore", root=self.root, index=1, apply=False)
        plan = preview["plan"]
        unchanged = snapshot(self.root) == before_restore
        self.check("preview (apply: false) writes nothing", unchanged and not preview["applied"],
                   "%s, delete %d, write %d, replace %d, unrestorable %d" % (
                       seconds(t0), *(listed(preview, "plan." + key) for key in (
                           "to_delete", "to_write", "to_replace", "unrestorable"))))
        unrestorable = [u if isinstance(u, str) else u.get("path") for u in plan["unrestorable"]]
        self.check("the changed .env is listed as unrestorable", ".env" in unrestorable,
                   "%s" % unrestorable[:5])

        t0 = time.monotonic()
        applied = self.server.call("tc_restore", root=self.root, index=1, apply=True)
        after = snapshot(self.root)
        differ = snapshot_diff(self.step1, after, ignore=[".env"])
        self.check("restore to step 1 is byte-exact", applied["applied"] and not differ,
                   "%s, %d files compared%s" % (seconds(t0), len(after),
                                                "; differ: %s" % differ[:5] if differ else ""))
        self.check("restore leaves the sensitive file alone",
                   after.get(".env") == before_restore.get(".env"), ".env untouched")
        recovered = applied.get("recovered")
        self.check("restore returns a recovered drift id", bool(recovered), str(recovered))

        t0 = time.monotonic()
        undo = self.server.call("tc_restore", root=self.root, drift_id=recovered, apply=True)
        after_undo = snapshot(self.root)
        differ = snapshot_diff(before_restore, after_undo)
        self.check("undo brings back every unsaved edit", undo["applied"] and not differ,
                   "%s, %d files compared%s" % (seconds(t0), len(after_undo),
                                                "; differ: %s" % differ[:5] if differ else ""))
        if self.git_ok:
            status_after = git_status(self.root)
            self.check("git status identical before and after the round trip",
                       status_before == status_after,
                       "%d status line(s)" % len(status_after.splitlines()))
        self.check_secret_absent(os.path.join(self.root, ".checkpoints"), "after restore")

    # -- 5. export and import ---------------------------------------------------

    def export_and_import(self):
        self.report.section("handoff package: export, import elsewhere")
        t0 = time.monotonic()
        exported = self.server.call("tc_export", root=self.root, to=self.exchange)
        package = exported["path"]
        filtered = [f if isinstance(f, str) else f.get("path") for f in exported["filtered"]]
        self.check("tc_export", os.path.isfile(os.path.join(package, "HANDOFF.md")),
                   "%s, %d files, %s, filtered %s" % (seconds(t0), listed(exported, "files"),
                                                      human_bytes(dir_bytes(package)), filtered))
        self.check("sensitive and >100 MB files are filtered out",
                   ".env" in filtered and "assets/huge.img" in filtered, "%d filtered" % len(filtered))
        self.check_secret_absent(package, "in the package")

        os.makedirs(self.colleague)
        t0 = time.monotonic()
        imported = self.server.call("tc_import", root=self.colleague, package=package)
        got = snapshot(self.colleague)
        head_files = self.snapshot_of_head()
        expected = set(head_files) - set(filtered)
        with open(os.path.join(package, "handoff.json"), encoding="utf-8") as fh:
            packed = {f["path"] for f in json.load(fh)["files"]}
        self.check("the package holds every other file of the step",
                   packed == expected and listed(exported, "files") == len(expected),
                   "%d of %d files" % (len(packed), len(head_files)))
        want = {rel: sha for rel, sha in head_files.items() if rel in expected}
        differ = snapshot_diff(want, got)
        self.check("tc_import writes the step's files byte-exact",
                   imported["task_id"] == self.task_id and not differ and len(got) == len(want),
                   "%s, %d files%s" % (seconds(t0), len(got),
                                       "; differ: %s" % differ[:5] if differ else ""))
        self.check("the imported workspace has no .env", ".env" not in got, "")
        resume = self.server.call("tc_resume", root=self.colleague)
        self.check("tc_resume in the second workspace",
                   resume["head"] == self.head and resume["health"]["ok"],
                   "head %s, next: %s" % (resume["head"], resume["next"]))

    def snapshot_of_head(self):
        return self.acked_snapshot if self.head == self.acked_index else self.unsaved

    # -- 6. the user's git ------------------------------------------------------

    def check_git_untouched(self):
        if not self.git_ok or self.fingerprint is None:
            return
        self.report.section("the user's git is untouched")
        now = git_fingerprint(self.root)
        for key, value in self.fingerprint.items():
            figure = value if isinstance(value, str) else json.dumps(value)
            self.check("git %s unchanged" % key, now[key] == value,
                       figure.strip().replace("\n", "; ")[:60])
        refs = git(self.root, "for-each-ref", "--format=%(refname)", "refs/").split()
        ours = [r for r in refs if r.startswith("refs/checkpoints/")]
        others = [r for r in refs if not r.startswith(("refs/checkpoints/", "refs/heads/",
                                                       "refs/tags/", "refs/stash"))]
        self.check("only refs/checkpoints/... was added", ours and not others,
                   "%d checkpoint ref(s)%s" % (len(ours), ", unexpected %s" % others if others else ""))
        if self.task_id and ours:
            ref = "refs/checkpoints/%s/s0001" % self.task_id
            shown = subprocess.run(["git", "show", "%s:src/app.py" % ref], cwd=self.root,
                                   env=git_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            self.check("checkpoint commit holds the step's content",
                       shown.returncode == 0 and shown.stdout == self.step1_app,
                       "%s:src/app.py, %s" % (ref, human_bytes(len(shown.stdout))))
            tree = git(self.root, "ls-tree", "-r", "--name-only", ref)
            self.check("the .env file is not in the checkpoint tree", ".env" not in tree.split("\n"),
                       "%d paths in the tree" % len(tree.split()))
        t0 = time.monotonic()
        fsck = subprocess.run(["git", "fsck", "--no-dangling", "--no-progress"], cwd=self.root,
                              env=git_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.check("git fsck is clean", fsck.returncode == 0,
                   "%s%s" % (seconds(t0), "; " + fsck.stderr.decode()[:200] if fsck.returncode else ""))

    # -- running ------------------------------------------------------------------

    def run(self):
        phases = [self.build_workspace, self.first_steps, self.kill_during_save,
                  self.restore_and_undo, self.export_and_import]
        try:
            for phase in phases:
                phase()
        except DrillError as exc:
            self.check("drill step %s" % phase.__name__, False, str(exc)[:300])
        except Exception as exc:  # report and still check the repository
            self.check("drill step %s" % phase.__name__, False,
                       "%s: %s" % (type(exc).__name__, str(exc)[:300]))
        finally:
            if self.server is not None:
                self.server.close()
        try:
            self.check_git_untouched()
        except DrillError as exc:
            self.check("git checks", False, str(exc)[:300])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=3000,
                        help="number of small generated files (default 3000)")
    parser.add_argument("--big-mb", type=int, default=40,
                        help="size of the large file in MB (default 40)")
    parser.add_argument("--sparse-mb", type=int, default=150,
                        help="size of the sparse file in MB, over 100 (default 150)")
    args = parser.parse_args(argv)
    if not os.path.isfile(SERVER):
        print("cannot find the server at %s" % SERVER, file=sys.stderr)
        return 2

    report = Report()
    drill = Drill(args, report)
    print("task-checkpoint-mcp drill in %s" % drill.base, flush=True)
    drill.run()

    keep = os.environ.get("TC_DRILL_KEEP", "").lower() in ("1", "on", "true", "yes")
    if report.failed or keep:
        print("\nworkspace kept: %s" % drill.base)
    else:
        shutil.rmtree(drill.base, ignore_errors=True)
        print("\nworkspace deleted")
    total = time.monotonic() - report.start
    print("%d passed, %d failed in %.1f s" % (report.passed, report.failed, total))
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
