"""Shared test helpers: a real server over stdio, real workspaces, real git.

Every black-box test drives the server in `scripts/tc_mcp.py` as a
subprocess, exactly the way an MCP client does: one JSON-RPC message per line
on stdin, one response line per request on stdout.

Besides the helpers every file uses, the harnesses that several test files
share: ToolsTest (calls checked against the tools' declared schemas),
SeededTest and the kill helpers (servers killed at seeded random moments),
and EditedMeanwhileTest (the core driven in-process while another program
writes at a fixed moment).
"""

import hashlib
import json
import os
import random
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import unittest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVER = os.path.join(REPO, "scripts", "tc_mcp.py")
SCRIPTS = os.path.join(REPO, "scripts")
sys.path.insert(0, SCRIPTS)
import tc  # noqa: E402  (the core, for the harnesses that drive it in-process)

# How the tests start the server. It is standard library only, so it runs
# without the site module: no site-packages, no .pth files. That keeps any
# installed package from being picked up by mistake, and skips a start-up
# cost the suite would otherwise pay for each of its hundreds of servers.
# (tests/test_packaging.py and tests/test_npm.py start it the ways users do.)
SERVER_COMMAND = (sys.executable, "-S", SERVER)
# What Server starts unless told otherwise: the same module run with -m, as
# `python -m tc_mcp` and the installed entry points run it. Its compiled code
# is then cached, while a script is compiled anew at every start (about 20 ms
# for tc_mcp.py, paid by each of the suite's servers). Tests that start
# SERVER_COMMAND, and the packaging tests, run the script itself.
MODULE_COMMAND = (sys.executable, "-S", "-m", "tc_mcp")


def suite_temp_root():
    """Where the suite's temporary folders go: TC_TEST_TMPDIR when set, else
    Linux's memory file system /dev/shm when it is writable, lets programs
    run and has room, else None (the system's temporary folder).

    Why: the suite makes and deletes a few hundred thousand files. On ext4,
    a file created soon after many deletions in the same block group makes
    the inode allocator step over every inode freed in the last half minute,
    and on a disk that costs the suite about a third of its time. The code
    paths are the same on both (tmpfs is one of the file systems whose
    syncfs the server trusts)."""
    chosen = os.environ.get("TC_TEST_TMPDIR")
    if chosen:
        os.makedirs(chosen, exist_ok=True)
        return chosen
    shm = "/dev/shm"
    if not sys.platform.startswith("linux") or not os.access(shm, os.W_OK | os.X_OK):
        return None
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as fh:
            rows = [line.split() for line in fh]
        room = os.statvfs(shm)
    except OSError:
        return None
    options = [row[3].split(",") for row in rows if len(row) > 3 and row[1] == shm]
    if not options or "noexec" in options[-1]:
        return None
    if room.f_bavail * room.f_frsize < 2 << 30:  # a container's 64 MB /dev/shm: no
        return None
    return shm


tempfile.tempdir = suite_temp_root()


# What the file system of the temporary folder and this user can do. Each is
# tried once, in a folder of its own, the first time a test asks.
_CAN = {}


def _tried(name, attempt):
    if name not in _CAN:
        folder = tempfile.mkdtemp(prefix="tc-probe-")
        try:
            _CAN[name] = bool(attempt(folder))
        except (OSError, NotImplementedError, ValueError):
            _CAN[name] = False
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    return _CAN[name]


def can_symlink():
    """Whether this user may make symlinks (Windows allows it only with
    developer mode or the symlink privilege)."""
    def attempt(folder):
        os.symlink("target", os.path.join(folder, "link"))
        return os.path.islink(os.path.join(folder, "link"))
    return _tried("symlink", attempt)


def keeps_mode_bits():
    """Whether chmod sets the permission bits as given (on Windows it only
    sets or clears the read-only flag: no executable bit, no 0o600)."""
    def attempt(folder):
        path = os.path.join(folder, "file")
        with open(path, "wb"):
            pass
        os.chmod(path, 0o750)
        return stat.S_IMODE(os.stat(path).st_mode) == 0o750
    return _tried("mode bits", attempt)


def is_root():
    """The POSIX superuser, whom permission bits do not stop (no such user on Windows)."""
    return hasattr(os, "geteuid") and os.geteuid() == 0


def path_max():
    """The longest path the temporary folder's file system takes (PATH_MAX:
    4096 on Linux, 1024 on macOS); None where it cannot be asked (Windows)."""
    try:
        return os.pathconf(tempfile.gettempdir(), "PC_PATH_MAX")
    except (AttributeError, OSError, ValueError):
        return None


# Quiet defaults for tests: no watcher, no git unless a test asks for them.
BASE_ENV = {
    "TC_WATCH": "off",
    "TC_GIT": "off",
}


def clean_env(extra=None):
    """The process environment minus anything TC_/GIT_ that could leak in."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("TC_") and not k.startswith("GIT_")}
    env.update(BASE_ENV)
    # Let the server cache its compiled modules: compiling scripts/tc.py on
    # every start would dominate a suite that starts hundreds of servers.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if extra:
        for key, value in extra.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
    return env


class ToolResult:
    """One tools/call outcome: the structured result, the text, the error flag."""

    def __init__(self, raw):
        self.raw = raw
        result = raw.get("result") or {}
        self.is_error = bool(result.get("isError"))
        content = result.get("content") or [{}]
        self.text = content[0].get("text", "")
        self.data = result.get("structuredContent")

    def __getitem__(self, key):
        return self.data[key]

    def __repr__(self):
        return "ToolResult(is_error=%r, text=%r)" % (self.is_error, self.text[:500])


class Server:
    """A real `tc_mcp.py` subprocess spoken to over stdio."""

    def __init__(self, env=None, cwd=None, args=(), command=None):
        self.env = clean_env(env)
        if command is None:
            command = MODULE_COMMAND
            self.env["PYTHONPATH"] = os.pathsep.join(
                filter(None, (self.env.get("PYTHONPATH"), SCRIPTS)))
        self.proc = subprocess.Popen(
            list(command) + list(args),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=self.env, cwd=cwd or tempfile.gettempdir())
        self._id = 0
        self.stderr_chunks = []
        self._err_thread = threading.Thread(target=self._drain_stderr, daemon=True)
        self._err_thread.start()

    def _drain_stderr(self):
        for chunk in iter(lambda: self.proc.stderr.read(4096), b""):
            self.stderr_chunks.append(chunk)

    @property
    def stderr(self):
        return b"".join(self.stderr_chunks).decode("utf-8", "replace")

    def send_raw(self, data):
        """Write raw bytes (a line terminator is not added)."""
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def read_line(self):
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError("server closed stdout; stderr:\n" + self.stderr)
        return json.loads(line.decode("utf-8"))

    def request(self, method, params=None):
        """Send one request and return the whole response message."""
        self._id += 1
        msg = {"jsonrpc": "2.0", "id": self._id, "method": method}
        if params is not None:
            msg["params"] = params
        self.send_raw((json.dumps(msg) + "\n").encode("utf-8"))
        reply = self.read_line()
        assert reply.get("id") == self._id, reply
        return reply

    def notify(self, method, params=None):
        msg = {"jsonrpc": "2.0", "method": method}
        if params is not None:
            msg["params"] = params
        self.send_raw((json.dumps(msg) + "\n").encode("utf-8"))

    def initialize(self, version="2025-06-18"):
        reply = self.request("initialize", {
            "protocolVersion": version, "capabilities": {},
            "clientInfo": {"name": "tests", "version": "0"}})
        self.notify("notifications/initialized")
        return reply

    def call(self, name, /, **arguments):
        """tools/call; returns a ToolResult (raises on a JSON-RPC error)."""
        reply = self.request("tools/call", {"name": name, "arguments": arguments})
        if "error" in reply:
            raise AssertionError("JSON-RPC error for %s: %r" % (name, reply["error"]))
        return ToolResult(reply)

    def ok(self, name, /, **arguments):
        """tools/call that must succeed; returns the structured result."""
        res = self.call(name, **arguments)
        if res.is_error:
            raise AssertionError("%s failed: %s" % (name, res.text))
        return res.data

    def close(self, timeout=10):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for stream in (self.proc.stdout, self.proc.stdin):
            try:
                stream.close()
            except OSError:
                pass
        self._err_thread.join(timeout=5)
        if not self._err_thread.is_alive():
            self.proc.stderr.close()

    def kill(self):
        """SIGKILL, no chance to clean up."""
        self.proc.kill()
        self.proc.wait()
        self.close()


def write(root, rel, data, mode=None):
    path = os.path.join(root, *rel.split("/"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if isinstance(data, str):
        data = data.encode("utf-8")
    with open(path, "wb") as fh:
        fh.write(data)
    if mode is not None:
        os.chmod(path, mode)
    return path


def read(root, rel):
    with open(os.path.join(root, *rel.split("/")), "rb") as fh:
        return fh.read()


def sha(data):
    """The sha256 of data in hex: the name the store gives that content."""
    return hashlib.sha256(data).hexdigest()


def store_holds(store, data):
    """Whether the store's payload folder holds data, under its sha."""
    path = os.path.join(store, "payload", sha(data)[:2], sha(data))
    return os.path.exists(path)


def paths_of(items):
    """The set of paths in a list of plain paths or of {"path": ...} entries
    (a restore plan, skipped_paths, a package's files); None counts as empty."""
    return {item if isinstance(item, str) else item.get("path") for item in items or ()}


def head_index(head):
    """The step number a head value names (a number, or {"index": n}), else None."""
    if isinstance(head, dict):
        head = head.get("index")
    return head if isinstance(head, int) and not isinstance(head, bool) else None


def snapshot(root, skip=(".checkpoints", ".git")):
    """{relative path: (bytes, mode bits)} of every regular file under root."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        for name in filenames:
            full = os.path.join(dirpath, name)
            if os.path.islink(full):
                continue
            rel = os.path.relpath(full, root).replace(os.sep, "/")
            with open(full, "rb") as fh:
                out[rel] = (fh.read(), os.stat(full).st_mode & 0o777)
    return out


def file_bytes(root):
    """{relative path: bytes} of every regular file under root, the store and .git left out."""
    return {k: v[0] for k, v in snapshot(root).items()}


def tree_listing(root):
    """Every path (files and directories) under root, with sizes: a cheap fingerprint."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames) + dirnames:
            full = os.path.join(dirpath, name)
            st = os.lstat(full)
            out.append((os.path.relpath(full, root), st.st_size if os.path.isfile(full) else -1))
    return sorted(out)


def git(cwd, *args, check=True, env=None, input=None):
    """Run real git with a fixed identity and no user config."""
    full_env = clean_env({
        "GIT_CONFIG_NOSYSTEM": "1", "HOME": cwd if env is None or "HOME" not in env else env["HOME"],
        "GIT_AUTHOR_NAME": "Test", "GIT_AUTHOR_EMAIL": "test@example.com",
        "GIT_COMMITTER_NAME": "Test", "GIT_COMMITTER_EMAIL": "test@example.com",
    })
    if env:
        full_env.update(env)
    proc = subprocess.run(["git", *args], cwd=cwd, env=full_env, input=input,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if check and proc.returncode != 0:
        raise AssertionError("git %s failed: %s" % (" ".join(args), proc.stderr.decode()))
    return proc.stdout


def make_git_repo(root, commit=True):
    """A real repository in root, with one commit unless commit=False."""
    git(root, "init", "-q", "-b", "main")
    if commit:
        write(root, "README.txt", "hello\n")
        git(root, "add", "README.txt")
        git(root, "commit", "-q", "-m", "initial")
    return root


def store_problems(store):
    """JSON files that do not parse and payloads whose bytes miss their hash."""
    problems = []
    for dirpath, _dirnames, filenames in os.walk(store):
        for name in filenames:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, store)
            parts = rel.split(os.sep)
            if name.endswith(".json"):
                try:
                    with open(full, "rb") as fh:
                        json.loads(fh.read().decode("utf-8"))
                except ValueError as exc:
                    problems.append("%s does not parse: %s" % (rel, exc))
            elif parts[0] == "payload" and len(parts) == 3 and len(name) == 64:
                with open(full, "rb") as fh:
                    digest = hashlib.sha256(fh.read()).hexdigest()
                if digest != name or parts[1] != name[:2]:
                    problems.append("%s does not match its hash" % rel)
    return problems


def stored_shas(store):
    """{sha: path} of every content file under the store's payload folder."""
    base = os.path.join(store, "payload")
    found = {}
    for prefix in (os.listdir(base) if os.path.isdir(base) else ()):
        folder = os.path.join(base, prefix)
        if os.path.isdir(folder):
            for name in os.listdir(folder):
                if len(name) == 64:
                    found[name] = os.path.join(folder, name)
    return found


def unnamed_payloads(store):
    """Stored content that no task record mentions by its sha."""
    mentioned = set()
    for dirpath, _dirnames, filenames in os.walk(os.path.join(store, "tasks")):
        for name in filenames:
            if name.endswith(".json"):
                with open(os.path.join(dirpath, name), "rb") as fh:
                    mentioned.update(re.findall(r"[0-9a-f]{64}", fh.read().decode("utf-8")))
    return sorted(set(stored_shas(store)) - mentioned)


def drift_key(record):
    for key in ("id", "drift_id"):
        if key in record:
            return record[key]
    raise AssertionError("drift record without an id: %r" % (record,))


def drift_paths(record, kind):
    """The sorted paths a drift record lists as added, modified or deleted."""
    if kind in record:
        value = record[kind]
    elif isinstance(record.get("changes"), dict) and kind in record["changes"]:
        value = record["changes"][kind]
    else:
        raise AssertionError("drift record has no %r list: %r" % (kind, record))
    return sorted(e if isinstance(e, str) else e["path"] for e in value)


class WorkspaceTest(unittest.TestCase):
    """A fresh temporary workspace per test, and servers that are always closed."""

    server_env = None

    def setUp(self):
        self._tmp = tempfile.mkdtemp(prefix="tc-test-")
        self.tmp = os.path.realpath(self._tmp)
        self.root = os.path.join(self.tmp, "ws")
        os.makedirs(self.root)
        self._servers = []

    def tearDown(self):
        for srv in self._servers:
            try:
                srv.close()
            except Exception:
                pass
        for dirpath, dirnames, filenames in os.walk(self.tmp):
            for name in dirnames + filenames:
                full = os.path.join(dirpath, name)
                try:
                    os.chmod(full, 0o755, follow_symlinks=False)
                except NotImplementedError:  # Windows before 3.13 has no lchmod
                    try:
                        if not os.path.islink(full):
                            os.chmod(full, 0o755)
                    except OSError:
                        pass
                except OSError:
                    pass
        shutil.rmtree(self._tmp, ignore_errors=True)

    def server(self, env=None, **kwargs):
        merged = dict(self.server_env or {})
        merged.update(env or {})
        srv = Server(env=merged, **kwargs)
        srv.initialize()
        self._servers.append(srv)
        return srv

    def write(self, rel, data, mode=None):
        return write(self.root, rel, data, mode)

    def other_dir(self, prefix="tc-other-"):
        """A separate temporary directory, as on another machine."""
        path = os.path.realpath(tempfile.mkdtemp(prefix=prefix))
        self.addCleanup(shutil.rmtree, path, True)
        return path

    def read(self, rel):
        return read(self.root, rel)

    @property
    def store(self):
        return os.path.join(self.root, ".checkpoints")


# The result fields the contract promises for each tool ("all present").
CONTRACT_RESULTS = {
    "tc_init": ["task_id", "name", "store", "store_is_external", "prev_suspended", "exclude", "note"],
    "tc_switch": ["task_id", "status"],
    "tc_save": ["task_id", "index", "title", "groups", "skipped_paths", "idempotent", "closed",
                "status", "active_task_changed", "git"],
    "tc_capture": ["captured", "waiting", "drift_id", "partial", "reads", "skipped_paths"],
    "tc_show": ["steps", "drifts", "head", "next_cursor"],
    "tc_restore": ["applied", "recovered", "plan", "skipped_paths"],
    "tc_resume": ["goal", "constraints", "head", "last", "open_questions", "drift_paths", "next",
                  "handoff", "health", "store", "active_task", "skipped"],
    "tc_export": ["path", "filtered", "files"],
    "tc_import": ["task_id"],
    "tc_compress": ["converted", "eligible", "already_gone", "bytes_freed", "keep_seconds",
                    "minimum", "maximum"],
}


# The JSON Schema types the tools' schemas use.
_TYPES = {
    "null": lambda v: v is None,
    "boolean": lambda v: isinstance(v, bool),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "string": lambda v: isinstance(v, str),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
}


def schema_errors(value, schema, path="$"):
    """The ways `value` breaks `schema` (the subset of JSON Schema our tools use)."""
    if schema is True or not isinstance(schema, dict):
        return []
    errors = []
    if "anyOf" in schema or "oneOf" in schema:
        key = "anyOf" if "anyOf" in schema else "oneOf"
        matches = sum(1 for alt in schema[key] if not schema_errors(value, alt, path))
        if matches == 0 or (key == "oneOf" and matches > 1):
            errors.append("%s: %d alternatives of %s match" % (path, matches, key))
    types = schema.get("type")
    if types is not None:
        types = [types] if isinstance(types, str) else list(types)
        unknown = [t for t in types if t not in _TYPES]
        if unknown:
            errors.append("%s: schema uses unknown type %r" % (path, unknown))
        if not any(_TYPES.get(t, lambda v: False)(value) for t in types):
            return errors + ["%s: %r is not of type %s" % (path, value, types)]
    if "enum" in schema and value not in schema["enum"]:
        errors.append("%s: %r not in enum %r" % (path, value, schema["enum"]))
    if "const" in schema and value != schema["const"]:
        errors.append("%s: %r is not %r" % (path, value, schema["const"]))
    if _TYPES["number"](value):
        if "minimum" in schema and value < schema["minimum"]:
            errors.append("%s: %r below minimum %r" % (path, value, schema["minimum"]))
        if "maximum" in schema and value > schema["maximum"]:
            errors.append("%s: %r above maximum %r" % (path, value, schema["maximum"]))
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for name in schema.get("required", []):
            if name not in value:
                errors.append("%s: required field %r missing" % (path, name))
        for name, item in value.items():
            if name in props:
                errors += schema_errors(item, props[name], "%s.%s" % (path, name))
            elif schema.get("additionalProperties") is False:
                errors.append("%s: field %r not declared" % (path, name))
            elif isinstance(schema.get("additionalProperties"), dict):
                errors += schema_errors(item, schema["additionalProperties"],
                                        "%s.%s" % (path, name))
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            errors += schema_errors(item, schema["items"], "%s[%d]" % (path, i))
    return errors


class ToolsTest(WorkspaceTest):
    """Calls checked against the contract: a successful result must match the
    outputSchema its tool declares and hold every field CONTRACT_RESULTS
    names; a refusal is one line with no traceback. One server per class
    (each test has its own workspace); more on demand."""

    _schemas = None
    shared = None

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.shared = None

    @classmethod
    def tearDownClass(cls):
        if cls.shared is not None:
            cls.shared.close()
        super().tearDownClass()

    def setUp(self):
        super().setUp()
        cls = type(self)
        if cls.shared is None or cls.shared.proc.poll() is not None:
            cls.shared = Server(env=self.server_env)
            cls.shared.initialize()
        self.srv = cls.shared
        if ToolsTest._schemas is None:
            tools = self.srv.request("tools/list")["result"]["tools"]
            ToolsTest._schemas = {t["name"]: t for t in tools}
        self.schemas = ToolsTest._schemas

    def ok(self, name, /, srv=None, **arguments):
        """A successful call whose result matches the tool's outputSchema."""
        res = (srv or self.srv).call(name, **arguments)
        self.assertFalse(res.is_error, "%s%r failed: %s" % (name, arguments, res.text))
        result = res.raw["result"]
        self.assertIs(result.get("isError"), False)
        self.assertEqual(result["content"][0]["type"], "text")
        self.assertEqual(json.loads(res.text), res.data, "text and structuredContent differ")
        errors = schema_errors(res.data, self.schemas[name]["outputSchema"])
        self.assertEqual(errors, [], "%s result breaks its outputSchema" % name)
        for field in CONTRACT_RESULTS[name]:
            self.assertIn(field, res.data)
        return res.data

    def refused(self, name, /, srv=None, **arguments):
        """A refused call: isError with a one-line message and no traceback."""
        res = (srv or self.srv).call(name, **arguments)
        self.assertTrue(res.is_error, "%s%r was accepted: %r" % (name, arguments, res.data))
        self.assertTrue(res.text.strip())
        self.assertNotIn("Traceback", res.text)
        self.assertNotIn("\n", res.text.strip(), "message should be one line: %r" % res.text)
        return res

    def init(self, name="Refactor auth", **kwargs):
        return self.ok("tc_init", root=self.root, name=name, **kwargs)

    def save(self, title, **kwargs):
        return self.ok("tc_save", root=self.root, title=title, **kwargs)

    def task_dir(self, task_id, store=None):
        return os.path.join(store or self.store, "tasks", task_id)

    def step_files(self, task_id, store=None):
        steps = os.path.join(self.task_dir(task_id, store), "steps")
        return sorted(os.listdir(steps)) if os.path.isdir(steps) else []

    def prepare(self):
        """A task with two steps, then unsaved work: src/a.py edited,
        src/new_file.py made, src/gone.py deleted. Returns the task id."""
        task = self.init(name="Refactor auth", goal="Move sessions to JWT",
                         constraints="keep the public API")["task_id"]
        self.write("src/a.py", "a = 1\n")
        self.write("src/b.py", "b = 1\n")
        self.write("src/gone.py", "gone = 1\n")
        self.save("Split the module", conclusion="it splits", next="write the service")
        self.save("Wrote the service layer", conclusion="service works",
                  description="because reasons", next="Switch the three views",
                  open_questions=["keep the old endpoint?"])
        self.write("src/a.py", "a = 2  # edited after the save\n")
        self.write("src/new_file.py", "n = 1\n")
        os.remove(os.path.join(self.root, "src", "gone.py"))
        return task


# Tests that kill servers at random moments (tests/test_crash.py,
# tests/test_rollback.py) draw those moments and their files from one seed:
# set CRASH_SEED to replay a run; every failure message names the seed in use.
CRASH_SEED = int(os.environ.get("CRASH_SEED") or random.SystemRandom().randrange(1 << 30))


def fill_workspace(root, rng, files=300, dirs=12, big=2, big_size=512 * 1024):
    """A workspace that takes a save a noticeable moment: many files, a few MB."""
    names = []
    for i in range(files):
        rel = "d%02d/sub%d/f%03d.dat" % (i % dirs, i % 3, i)
        names.append(rel)
    for i in range(big):
        names.append("big/b%d.bin" % i)
    for rel in names:
        size = big_size if rel.startswith("big/") else rng.randrange(2000, 14000)
        write(root, rel, rng.randbytes(size))
    return names


def mutate(root, rng, names, tag, share=0.15):
    """Rewrite a share of the files, delete a few, add a few (none saved)."""
    for rel in rng.sample(names, int(len(names) * share)):
        write(root, rel, rng.randbytes(rng.randrange(1000, 9000)))
    for rel in rng.sample(names, 3):
        path = os.path.join(root, *rel.split("/"))
        if os.path.exists(path):
            os.remove(path)
    for i in range(3):
        rel = "new/%s/n%d.txt" % (tag, i)
        write(root, rel, ("%s %d %s\n" % (tag, i, rng.random())).encode())
        names.append(rel)


def send(srv, name, /, **arguments):
    """Send a tools/call without waiting for its answer; returns its id."""
    srv._id += 1
    msg = {"jsonrpc": "2.0", "id": srv._id, "method": "tools/call",
           "params": {"name": name, "arguments": arguments}}
    srv.send_raw((json.dumps(msg) + "\n").encode("utf-8"))
    return srv._id


def kill_and_collect(srv, request_id):
    """SIGKILL now; return the answer to request_id if it was already written."""
    srv.proc.kill()
    srv.proc.wait()
    rest = srv.proc.stdout.read()
    try:
        srv.proc.stdin.close()
    except OSError:
        pass
    srv.close()
    for line in rest.splitlines():
        try:
            msg = json.loads(line.decode("utf-8"))
        except ValueError:
            continue
        if msg.get("id") == request_id:
            return msg
    return None


class SeededTest(WorkspaceTest):
    """A workspace test with self.rng seeded from CRASH_SEED, and
    self.seed_note to put in its failure messages."""

    def setUp(self):
        super().setUp()
        self.rng = random.Random(CRASH_SEED)
        self.seed_note = "CRASH_SEED=%d" % CRASH_SEED


class EditedMeanwhileTest(WorkspaceTest):
    """A core instance on the workspace (self.cp), two steps to restore
    between, and another program that writes at a fixed moment: right after a
    restore's or an import's journal reaches the disk, through the real
    Journal.begin."""

    def setUp(self):
        super().setUp()
        self.cp = tc.Checkpoints(tc.Config(watch=False, git=False))

    def edit_once_the_journal_is_written(self, edits):
        """edits: {rel: bytes, or None to delete} written right after the
        next journal's plan reaches the disk."""
        original = tc.Journal.begin

        def begin(journal, *args, **kwargs):
            result = original(journal, *args, **kwargs)
            tc.Journal.begin = original
            for rel, data in edits.items():
                if data is None:
                    os.remove(os.path.join(self.root, rel))
                else:
                    self.write(rel, data)
            return result

        tc.Journal.begin = begin
        self.addCleanup(setattr, tc.Journal, "begin", original)

    def folder_then_file(self, inside, file_text=None):
        """Step 1 holds the file inside (x/inside.txt) and plain.txt; at
        step 2 inside's folder is gone, a file in its place when file_text
        is given, and plain.txt is longer."""
        folder = inside.rsplit("/", 1)[0]
        self.write(inside, "in the folder at step 1\n")
        self.write("plain.txt", "plain 1\n")
        self.cp.init(self.root, "shapes")
        self.cp.save(self.root, "one")
        os.remove(os.path.join(self.root, *inside.split("/")))
        os.rmdir(os.path.join(self.root, folder))
        if file_text is not None:
            self.write(folder, file_text)
        self.write("plain.txt", "plain 2, longer\n")
        self.cp.save(self.root, "two")

    def two_steps(self):
        """Step 1 and step 2 differ in replaced.txt, deleted.txt (only in
        step 2) and written.txt (only in step 1); plain.txt too."""
        self.write("replaced.txt", "replaced at step 1\n")
        self.write("written.txt", "only at step 1\n")
        self.write("plain.txt", "plain 1\n")
        self.cp.init(self.root, "edits")
        self.cp.save(self.root, "one")
        self.write("replaced.txt", "replaced at step 2, longer\n")
        os.remove(os.path.join(self.root, "written.txt"))
        self.write("deleted.txt", "only at step 2\n")
        self.write("plain.txt", "plain 2, longer\n")
        self.cp.save(self.root, "two")

    def step_files(self, index):
        shown = self.cp.show(self.root, index=index, limit=200)["steps"][0]["files"]
        return {f["path"]: f["sha256"] for f in shown}
