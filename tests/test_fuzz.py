"""Hostile and malformed input on the stdio server: a seeded, deterministic fuzz run.

Each message is followed by a `ping` with a private id, so the test knows
exactly which stdout lines belong to which input line. After every message
it checks that the server (a) is alive, (b) wrote only JSON-RPC frames, one
per line, in strict JSON, (c) answered a request exactly once and a
notification never, (d) used the contract's error codes (never -32603, never
a traceback, a one-line isError text), (e) answered within 10 s, (f) changed
nothing outside the workspaces it was given, and at the end that (g) a fresh
server still reads every store with health ok.

The fixed-input tests below the fuzz run pin the defects the fuzzing found.
"""

import json
import os
import queue
import random
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import unittest

from support import SERVER_COMMAND, clean_env

SEED = 20261129
MESSAGES = 400
TOOLS = ("tc_init", "tc_switch", "tc_save", "tc_capture", "tc_show", "tc_restore",
         "tc_resume", "tc_export", "tc_import", "tc_compress")
SPEC_CODES = {-32700, -32600, -32601, -32602, -32022}
VERSION_KEY = "io.modelcontextprotocol/protocolVersion"
CAPABILITIES_KEY = "io.modelcontextprotocol/clientCapabilities"
SYNC = "fuzz-sync-"


def strict_json(text):
    """json.loads without the NaN / Infinity extensions JSON does not have."""
    def refuse(name):
        raise ValueError("%s is not JSON" % name)
    return json.loads(text, parse_constant=refuse)


class Proc:
    """A server subprocess with non-blocking line reads."""

    def __init__(self, cwd, env):
        self.p = subprocess.Popen(list(SERVER_COMMAND), stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                  cwd=cwd, env=env)
        self.buf = b""
        self.chunks = None
        if os.name == "nt":  # select() takes sockets only there: a thread reads the pipe
            self.chunks = queue.Queue()
            self.reader = threading.Thread(target=self._read_all, daemon=True)
            self.reader.start()

    def _read_all(self):
        fd = self.p.stdout.fileno()
        while True:
            chunk = os.read(fd, 1 << 20)
            self.chunks.put(chunk)
            if not chunk:
                return

    def _chunk(self, timeout):
        """The next bytes of stdout (b"" at EOF), or None after timeout seconds."""
        if self.chunks is not None:
            try:
                return self.chunks.get(timeout=timeout)
            except queue.Empty:
                return None
        fd = self.p.stdout.fileno()
        ready, _, _ = select.select([fd], [], [], timeout)
        return os.read(fd, 1 << 20) if ready else None

    def send(self, data):
        self.p.stdin.write(data)
        self.p.stdin.flush()

    def readline(self, timeout=10.0):
        """A line (with its newline), b"" at EOF, None on timeout."""
        while b"\n" not in self.buf:
            chunk = self._chunk(timeout)
            if chunk is None:
                return None
            if not chunk:
                if self.chunks is not None:
                    self.chunks.put(chunk)  # EOF stays EOF for the next call
                return b""
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line + b"\n"

    def close(self):
        try:
            self.p.stdin.close()
        except OSError:
            pass
        try:
            self.p.wait(10)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
        if self.chunks is not None:
            self.reader.join(10)  # it reads until EOF: only then is the pipe closed
        self.p.stdout.close()


class Sandbox:
    """base/{cwd,tmp,sibling,ws,ws2,out,ext} and base/afile; cwd, tmp and sibling are watched."""

    def __init__(self):
        self.base = os.path.realpath(tempfile.mkdtemp(prefix="tc-fuzz-"))
        for name in ("cwd", "tmp", "sibling", "ws", "ws2", "out", "ext"):
            os.makedirs(os.path.join(self.base, name))
        self.ws = os.path.join(self.base, "ws")
        self.ws2 = os.path.join(self.base, "ws2")
        self.out = os.path.join(self.base, "out")
        self.ext = os.path.join(self.base, "ext")
        for rel, text in (("afile", "a file\n"), ("sibling/keep.txt", "keep\n"),
                          ("cwd/keep.txt", "keep\n"), ("ws/a.txt", "a\n"), ("ws/b.p3d", "b"),
                          ("ws/sub/c.txt", "c\n"), ("ws2/z.txt", "z\n")):
            os.makedirs(os.path.dirname(os.path.join(self.base, rel)), exist_ok=True)
            with open(os.path.join(self.base, rel), "w", encoding="utf-8") as fh:
                fh.write(text)

    def fingerprint(self):
        out = {"<base>": tuple(sorted(os.listdir(self.base)))}
        for name in ("cwd", "tmp", "sibling"):
            for dirpath, dirnames, filenames in os.walk(os.path.join(self.base, name)):
                for entry in dirnames + filenames:
                    full = os.path.join(dirpath, entry)
                    st = os.lstat(full)
                    out[full] = (st.st_size, st.st_mtime_ns, st.st_mode)
        return out

    def remove(self):
        shutil.rmtree(self.base, ignore_errors=True)


class Generator:
    """Seeded messages: valid calls, mutated calls, envelopes and raw garbage."""

    def __init__(self, rng, sb):
        self.r = rng
        self.sb = sb
        self.tasks, self.drifts, self.packages = [], ["d0001"], []
        self.n = 0

    def next_id(self):
        self.n += 1
        return self.r.choice([self.n] * 6 + ["r%d" % self.n, self.n + 0.5, -self.n, "é%d" % self.n])

    def path(self, key="root"):
        sb = self.sb
        # System paths only where nothing can be written, even when run as root.
        choices = [sb.ws] * 5 + [
            sb.ws2, sb.ws + "/", sb.ws + "/sub/..", sb.ws + "/sub",
            os.path.join(sb.ws, ".checkpoints"), os.path.join(sb.base, "afile"),
            os.path.join(sb.base, "missing"), "ws", ".", "", "..", "../sibling", "./x", "~",
            sb.ws + "\x00", "/tmp\x00x", sb.ws + "\n", sb.ws + "\ud800", sb.ws + "/é中",
            "/", "//", "/proc", "/proc/self", "/dev/null", "C:\\x", " " + sb.ws,
            sb.ws + "/" + "a" * 300]
        if key == "to":
            choices += [sb.out] * 5
        elif key == "store":
            choices += [sb.ext] * 3 + [sb.ws + "/inner", sb.base]
        elif key == "package":
            choices += self.packages * 5 + [p + "/files" for p in self.packages]
        return self.r.choice(choices)

    def task_id(self):
        return self.r.choice(self.tasks * 3 + ["", "..", "a/b", "a\x00", "x" * 200, "\ud800",
                                               "no-such-task", "é"])

    def value(self, depth=0):
        r = self.r
        kind = r.randrange(10)
        if kind == 0:
            return r.choice([None, True, False])
        if kind == 1:
            return r.choice([0, -1, 1, 2 ** 70, -(2 ** 63), 200, 201, 2 ** 31])
        if kind == 2:
            return r.choice([1.5, -0.0, 1e300, 3.0, -1e-300])
        if kind == 3:
            return r.choice(["x" * 1001, "é" * 4097, "y" * 100_001, "\x00" * 5])
        if kind == 4:
            return self.path()
        if kind == 5:
            return r.choice(["", "x", "\ud800", "\udfff\ud800", "a\x00b", "two\nlines", "é中🙂"])
        if kind == 6 and depth < 3:
            return [self.value(depth + 1) for _ in range(r.randint(0, 3))]
        if kind == 7 and depth < 3:
            return {r.choice(["a", "root", "", "\ud800"]): self.value(depth + 1)}
        if kind == 8:
            return ["x"] * r.choice([2, 1001])
        return self.task_id()

    def arguments(self, tool):
        r, sb = self.r, self.sb
        a = {"root": sb.ws if r.random() < 0.85 else sb.ws2}
        if tool == "tc_init":
            a["name"] = r.choice(["refactor auth", "中文任务", "a/b..c", "x"])
            if r.random() < 0.2:
                a["exclude"] = r.choice([["*.log"], ["a/b"], ["["], [".."]])
            if r.random() < 0.1:
                a["store"] = sb.ext
        elif tool == "tc_switch":
            a["task_id"] = self.task_id()
        elif tool == "tc_save":
            a["title"] = r.choice(["step", "改动", "next step"])
            if r.random() < 0.3:
                a["conclusion"] = "done"
            if r.random() < 0.05:
                a["close"] = True
        elif tool == "tc_show":
            if r.random() < 0.4:
                a["index"] = r.randint(1, 4)
            if r.random() < 0.3:
                a["include_drift"] = True
        elif tool == "tc_restore":
            if r.random() < 0.5:
                a["index"] = r.randint(1, 4)
            else:
                a["drift_id"] = r.choice(self.drifts)
            a["apply"] = r.random() < 0.4
        elif tool == "tc_export":
            a["to"] = sb.out
            a["history"] = r.random() < 0.5
        elif tool == "tc_import":
            a["package"] = r.choice(self.packages or [sb.out])
            a["root"] = sb.ws2 if r.random() < 0.7 else sb.ws
        elif tool == "tc_compress" and r.random() < 0.3:
            a.update(keep_seconds=0, minimum=0, maximum=1)
        return a

    def mutate(self, a):
        r = self.r
        for _ in range(r.randint(1, 3)):
            kind = r.randrange(6)
            if kind == 0 and a:
                a[r.choice(sorted(a))] = self.value()
            elif kind == 1 and a:
                del a[r.choice(sorted(a))]
            elif kind == 2:
                a[r.choice(["extra", "paths", "index", "drift_id", "apply", "task_id", "store",
                            "to", "package", "limit", "cursor", "\ud800", ""])] = self.value()
            elif kind == 3:
                key = r.choice(["root", "to", "store", "package"])
                a[key] = self.path(key)
            elif kind == 4:
                a[r.choice(["index", "limit", "cursor", "keep_seconds", "minimum"])] = r.choice(
                    [0, -1, 2 ** 70, 1e300, 1.0, 201, True, "1", None, -0.0])
            else:
                a[r.choice(["title", "name", "goal", "description"])] = r.choice(
                    ["", " ", "x" * 1001, "\ud800", "a\x00", "\n\n"])
        return a

    def call(self, valid):
        tool = self.r.choice(TOOLS)
        a = self.arguments(tool)
        if not valid:
            a = self.mutate(a)
        params = {"name": tool, "arguments": a}
        if self.r.random() < 0.25:
            params["_meta"] = self.meta()
        return {"jsonrpc": "2.0", "id": self.next_id(), "method": "tools/call",
                "params": params}

    def meta(self):
        """params._meta: a progress token of any kind, or a 2026-07-28 envelope,
        whole or broken."""
        r = self.r
        envelope = {VERSION_KEY: "2026-07-28", CAPABILITIES_KEY: {}}
        return r.choice([
            {"progressToken": r.choice(["p1", 7, -1, 1.5, None, True, [], {}, "\ud800",
                                        2 ** 70, "x" * 5000])},
            envelope, dict(envelope, progressToken="p2"),
            {VERSION_KEY: r.choice(["2099-01-01", "", 2026, None, [], "\ud800", "z" * 3000])},
            dict(envelope, **{VERSION_KEY: "2025-11-25"}),
            dict(envelope, **{CAPABILITIES_KEY: r.choice([None, [], "x", 1])}),
            5, [], "x", None])

    def encode(self, msg):
        if self.r.random() < 0.7:
            return json.dumps(msg).encode("ascii")
        # raw UTF-8; lone surrogates become invalid UTF-8 bytes
        return json.dumps(msg, ensure_ascii=False).encode("utf-8", "surrogatepass")

    def envelope(self):
        r = self.r
        msg = {}
        if r.random() < 0.85:
            msg["jsonrpc"] = r.choice(["2.0"] * 5 + ["1.0", 2.0, None, ""])
        if r.random() < 0.85:
            msg["id"] = self.next_id() if r.random() < 0.6 else r.choice(
                [None, True, [], {}, [1], {"a": 1}, "", 0, 2 ** 70, 1e300, "\ud800"])
        if r.random() < 0.9:
            msg["method"] = r.choice(["initialize", "ping", "tools/list", "tools/call",
                                      "notifications/initialized", "resources/list", "", None,
                                      5, ["ping"], "\ud800", "tools/call\x00",
                                      "server/discover", "notifications/cancelled"])
        if r.random() < 0.7:
            msg["params"] = r.choice([
                {}, [], None, 1, "x", True, [1],
                {"protocolVersion": r.choice(["2025-06-18", "1999-01-01", 5, None])},
                {"name": r.choice(list(TOOLS) + ["nope", 5, None, ""]), "arguments": self.value()},
                {"name": r.choice(TOOLS), "arguments": None},
                {"requestId": r.choice([self.next_id(), 1, "1", None, [1], {}, 1e300,
                                        "\ud800", True])},
                {"_meta": self.meta()}])
        return msg

    def garbage(self):
        r = self.r
        d = r.choice([20, 900, 5000])
        ws = self.sb.ws.encode()
        return r.choice([
            bytes(r.randrange(1, 256) for _ in range(r.randint(1, 80))).replace(b"\n", b" "),
            b'{"jsonrpc":"2.0","id":1,"method":"ping","x":"\xff\xfe"}',
            b"\xef\xbb\xbf" + b'{"jsonrpc":"2.0","id":7,"method":"ping"}',
            b"\xed\xa0\x80{}", b"null", b"1", b'"x"', b"[]", b"{", b"}", b"\x00", b"{}",
            b'{"a":1}{"b":2}', b'[{"jsonrpc":"2.0","id":1,"method":"ping"}]',
            b'{"jsonrpc":"2.0","id":1,"method":"ping",}',
            b'{"jsonrpc":"2.0","id":1,"method":"ping","p":"\\udc00\\ud800"}',
            b"[" * d + b"]" * d, b'{"a":' * d + b"1" + b"}" * d,
            b'{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":'
            + b"[" * d + b"]" * d + b"}}",
            b'{"jsonrpc":"2.0","id":4,"method":"tools/call","params":{"name":"tc_save",'
            b'"arguments":{"root":"' + ws + b'","title":"t","verified":' + b"[" * d
            + b"]" * d + b"}}}",
            b"z" * 300_000,
            b'{"jsonrpc":"2.0","id":-0,"method":"ping"}',
            b'{"jsonrpc":"2.0","id":NaN,"method":"ping"}',
            b'{"jsonrpc":"2.0","id":1e400,"method":"ping"}',
            b'{"jsonrpc":"2.0","id":9,"method":"ping","params":-Infinity}',
            b'{"jsonrpc":"2.0","id":1180591620717411303424,"method":"ping"}',
            b'{"jsonrpc":"2.0","id":5,"method":"tools/call","params":{"name":"tc_show",'
            b'"arguments":{"root":"' + ws + b'","index":1e300,"cursor":-0}}}',
        ])

    def line(self):
        """(bytes, the message object or None when the line is not meant to parse)."""
        r = self.r
        k = r.random()
        if k < 0.40:
            msg = self.call(valid=r.random() < 0.55)
            return self.encode(msg), msg
        if k < 0.55:
            msg = self.envelope()
            return self.encode(msg), msg
        if k < 0.70:
            return self.garbage(), None
        if k < 0.78:
            data = json.dumps(self.call(valid=True)).encode()
            return data[:r.randint(1, len(data) - 2)], None
        if k < 0.86:  # a notification that names a tool
            msg = self.call(valid=True)
            del msg["id"]
            if r.random() < 0.5:
                msg["params"]["name"] = r.choice(["nope", None, 5, ""])
            return self.encode(msg), msg
        msg = self.call(valid=True)
        return self.encode(msg), msg

    def learn(self, msg, result):
        data = result.get("structuredContent")
        if not isinstance(data, dict):
            return
        tool = msg["params"]["name"]
        if tool in ("tc_init", "tc_import") and data.get("task_id") not in self.tasks:
            self.tasks.append(data["task_id"])
        for key in ("drift_id", "recovered"):
            if isinstance(data.get(key), str):
                self.drifts.append(data[key])
        if tool == "tc_export":
            self.packages.append(data["path"])


def parse_line(data):
    try:
        return True, strict_json(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return False, None


def check_answer(data, got):
    """Problems with the responses `got` to one input line (an empty list when fine)."""
    ok, msg = parse_line(data)
    if not ok:
        if not data.strip():
            return [] if not got else ["blank line answered: %r" % got]
        if len(got) != 1 or (got[0].get("error") or {}).get("code") != -32700:
            return ["a line that is not JSON wants one -32700 answer, got %r" % got]
        return []
    if not isinstance(msg, dict):
        if len(got) != 1 or (got[0].get("error") or {}).get("code") != -32600:
            return ["JSON that is not an object wants one -32600 answer, got %r" % got]
        return []
    if "id" not in msg:
        if isinstance(msg.get("method"), str) and msg.get("jsonrpc") == "2.0" and got:
            return ["a notification was answered: %r" % got]
        return [] if len(got) <= 1 else ["%d answers to one line" % len(got)]
    if not isinstance(msg.get("method"), str) and ("result" in msg or "error" in msg):
        return [] if len(got) <= 1 else ["%d answers to one line" % len(got)]
    if len(got) != 1:
        return ["a request wants exactly one answer, got %d: %r" % (len(got), got)]
    resp = got[0]
    problems = []
    if resp["id"] is not None and resp["id"] != msg["id"]:
        problems.append("answer id %r for request id %r" % (resp["id"], msg["id"]))
    err = resp.get("error")
    if err is not None:
        if err.get("code") not in SPEC_CODES:
            problems.append("error code outside the contract: %r" % err)
        if "Traceback" in str(err.get("message")):
            problems.append("traceback in an error: %r" % err)
    elif msg.get("method") == "tools/call" and isinstance(resp.get("result"), dict):
        result = resp["result"]
        if result.get("isError"):
            text = (result.get("content") or [{}])[0].get("text", "")
            if "Traceback" in text or "\n" in text or not text:
                problems.append("isError text is not one line: %r" % text[:300])
    return problems


class FuzzTest(unittest.TestCase):

    def setUp(self):
        self.sb = Sandbox()
        self.addCleanup(self.sb.remove)
        self.env = clean_env({"TMPDIR": os.path.join(self.sb.base, "tmp"),
                              "HOME": os.path.join(self.sb.base, "cwd")})

    def start(self):
        proc = Proc(os.path.join(self.sb.base, "cwd"), self.env)
        self.addCleanup(proc.close)
        return proc

    def exchange(self, proc, data, sync_id):
        """Send a line and a sync request; return (answers before it, problems).
        The sync is a method the server does not know: its error comes in
        turn, after every answer to the line (a ping may be answered at once
        while a call runs)."""
        ping = json.dumps({"jsonrpc": "2.0", "id": sync_id, "method": "fuzz/sync"}).encode()
        try:
            proc.send(data + b"\n" + ping + b"\n")
        except (BrokenPipeError, ConnectionResetError):
            return None, ["(a) the server is gone (exit %r)" % proc.p.poll()]
        got, problems = [], []
        while True:
            line = proc.readline(10)
            if line is None:
                return None, problems + ["(e) no answer within 10 s"]
            if line == b"":
                return None, problems + ["(a) the server exited (%r)" % proc.p.wait(5)]
            try:
                resp = strict_json(line.decode("utf-8"))
            except (UnicodeDecodeError, ValueError) as exc:
                problems.append("(b) stdout line is not strict JSON (%s): %r" % (exc, line[:200]))
                continue
            if (isinstance(resp, dict) and resp.get("method") == "notifications/progress"
                    and "id" not in resp and isinstance(resp.get("params"), dict)
                    and isinstance(resp["params"].get("progressToken"), (str, int))):
                continue  # a slow call that asked for progress
            if (not isinstance(resp, dict) or resp.get("jsonrpc") != "2.0" or "id" not in resp
                    or ("result" in resp) == ("error" in resp)):
                problems.append("(b) not a JSON-RPC response: %r" % line[:200])
                continue
            if resp["id"] == sync_id:
                return got, problems
            got.append(resp)

    def test_seeded_fuzz(self):
        print("\nfuzz seed %d" % SEED, file=sys.stderr)
        rng = random.Random(SEED)
        sb = self.sb
        gen = Generator(rng, sb)
        named = [sb.ws, sb.ws2, sb.out, sb.ext]
        failures = []
        proc = self.start()
        before = sb.fingerprint()
        init = json.dumps({"jsonrpc": "2.0", "id": 0, "method": "initialize",
                           "params": {"protocolVersion": "2025-06-18"}}).encode()
        for number in range(MESSAGES):
            if number == MESSAGES // 2:  # a second server process on the same stores
                proc.close()
                proc = self.start()
            data, msg = (init, None) if number in (0, MESSAGES // 2) else gen.line()
            if isinstance(msg, dict) and isinstance(msg.get("params"), dict):
                arguments = msg["params"].get("arguments")
                for key in ("root", "to", "store", "package"):
                    value = arguments.get(key) if isinstance(arguments, dict) else None
                    if isinstance(value, str) and os.path.isabs(value) and "\x00" not in value:
                        try:
                            named.append(os.path.realpath(value))
                        except (ValueError, UnicodeError):
                            pass
            got, problems = self.exchange(proc, data, "%s%d" % (SYNC, number))
            if got is None:  # dead or hung: note it and go on with a new process
                proc.close()
                proc = self.start()
            elif not problems:  # a broken frame already explains a missing answer
                problems += check_answer(data, got)
                if (len(got) == 1 and isinstance(msg, dict) and "result" in got[0]
                        and msg.get("method") == "tools/call"
                        and not got[0]["result"].get("isError")):
                    gen.learn(msg, got[0]["result"])
            after = sb.fingerprint()
            if after != before:
                changed = [p for p in set(after) | set(before) if after.get(p) != before.get(p)]
                changed = [os.path.join(sb.base, n) for n in
                           set(after["<base>"]) ^ set(before["<base>"])] + \
                          [p for p in changed if p != "<base>"]
                outside = [p for p in changed if not any(
                    p == n or p.startswith(n.rstrip(os.sep) + os.sep) for n in named)]
                if outside:
                    problems.append("(f) changed outside the workspaces: %r" % sorted(outside))
                before = after
            failures += ["line %r -> %s" % (data[:300], p) for p in problems]
        proc.close()
        failures += self.health_failures(gen)
        unique = sorted(set(failures))
        self.assertFalse(unique, "seed %d: %d problem(s):\n%s"
                         % (SEED, len(unique), "\n".join(unique[:40])))
        self.assertGreaterEqual(len(gen.tasks), 2, "the fuzz run must reach real tasks")

    def health_failures(self, gen):
        """(g): a fresh server reads every workspace's tasks with health ok."""
        proc = self.start()
        msgs = []
        for root in (self.sb.ws, self.sb.ws2):
            for task_id in [None] + gen.tasks:
                arguments = {"root": root}
                if task_id:
                    arguments["task_id"] = task_id
                msgs.append({"jsonrpc": "2.0", "id": len(msgs) + 1, "method": "tools/call",
                             "params": {"name": "tc_resume", "arguments": arguments}})
        proc.send(b"".join(json.dumps(m).encode() + b"\n" for m in msgs))
        failures = []
        for m in msgs:
            line = proc.readline(20)
            if not line:
                return failures + ["(g) the health server did not answer"]
            resp = json.loads(line)
            result = resp.get("result") or {}
            where = "(g) tc_resume %r" % m["params"]["arguments"]
            if "error" in resp:
                failures.append("%s -> %r" % (where, resp["error"]))
            elif result.get("isError"):
                text = result["content"][0]["text"]
                if not any(s in text for s in ("belongs to the workspace", "no active task",
                                               "does not exist in this store")):
                    failures.append("%s -> %s" % (where, text))
            elif not result["structuredContent"]["health"]["ok"]:
                failures.append("%s -> %r" % (where, result["structuredContent"]["health"]))
        return failures


class FoundDefectsTest(FuzzTest):
    """Single lines and short sequences the fuzz run found; each names what the contract wants."""

    test_seeded_fuzz = None

    def one(self, proc, data, sync="s"):
        got, problems = self.exchange(proc, data, SYNC + sync)
        self.assertEqual(problems, [], data)
        return got

    def call_line(self, number, tool, **arguments):
        return json.dumps({"jsonrpc": "2.0", "id": number, "method": "tools/call",
                           "params": {"name": tool, "arguments": arguments}}).encode()

    def test_tool_call_notification_with_bad_name_keeps_the_server_alive(self):
        proc = self.start()
        for n, line in enumerate([
                b'{"jsonrpc":"2.0","method":"tools/call","params":{"name":"nope"}}',
                b'{"jsonrpc":"2.0","method":"tools/call","params":{"name":5}}',
                b'{"jsonrpc":"2.0","method":"tools/call","params":1}',
                b'{"jsonrpc":"2.0","method":"tools/call","params":[]}']):
            self.assertEqual(self.one(proc, line, str(n)), [], line)

    def test_non_finite_numbers_are_not_json(self):
        proc = self.start()
        for n, line in enumerate([
                b'{"jsonrpc":"2.0","id":NaN,"method":"ping"}',
                b'{"jsonrpc":"2.0","id":Infinity,"method":"ping"}',
                b'{"jsonrpc":"2.0","id":-Infinity,"method":"ping"}',
                b'{"jsonrpc":"2.0","id":1,"method":"ping","params":NaN}']):
            got = self.one(proc, line, str(n))  # (b): a NaN id must never be echoed
            self.assertEqual(len(got), 1, line)
            self.assertEqual(got[0].get("error", {}).get("code"), -32700, (line, got))
        # 1e400 is JSON but overflows a double: the answer must still be strict
        # JSON, and the request is answered (an id no request may have) ...
        for n, big in enumerate([b"1e400", b"9" * 5000, b"-" + b"9" * 5000]):
            got = self.one(proc, b'{"jsonrpc":"2.0","id":%s,"method":"ping"}' % big,
                           "big%d" % n)
            self.assertEqual(len(got), 1)
            self.assertEqual(got[0].get("error", {}).get("code"), -32600, got)
        # ... or, in an argument, refused by name under the caller's own id.
        for n, argument in enumerate([b'"limit":1e400', b'"limit":-1e400',
                                      b'"keep_seconds":1e309', b'"limit":' + b"7" * 5000]):
            tool = b"tc_compress" if b"keep" in argument else b"tc_show"
            line = (b'{"jsonrpc":"2.0","id":%d,"method":"tools/call","params":{"name":"%s",'
                    b'"arguments":{"root":"/tmp",%s}}}' % (70 + n, tool, argument))
            got = self.one(proc, line, "arg%d" % n)
            self.assertEqual(len(got), 1, line)
            self.assertEqual(got[0].get("id"), 70 + n, got)
            self.assertTrue(got[0]["result"]["isError"], got)
            self.assertIn(argument.split(b'"')[1].decode(),
                          got[0]["result"]["content"][0]["text"])

    def test_nul_in_store_argument_is_a_tool_error(self):
        proc = self.start()
        for n, store in enumerate([self.sb.ext + "\x00", "/tmp/\x00x"]):
            got = self.one(proc, self.call_line(n, "tc_init", root=self.sb.ws, name="x",
                                                store=store), str(n))
            self.assertEqual(len(got), 1)
            self.assertNotIn("error", got[0], got[0])  # not -32603
            self.assertTrue(got[0]["result"]["isError"], got[0])
            self.assertIn("store", got[0]["result"]["content"][0]["text"])
        self.assertFalse(os.path.exists(os.path.join(self.sb.ws, ".checkpoints")))

    def test_store_as_workspace_root_cannot_destroy_its_records(self):
        """root = <ws>/.checkpoints: a restore there must not delete the outer task's
        step records, and step numbers must never be reused."""
        sb = self.sb
        proc = self.start()
        store = os.path.join(sb.ws, ".checkpoints")

        def call(n, tool, **arguments):
            got = self.one(proc, self.call_line(n, tool, **arguments), str(n))
            self.assertEqual(len(got), 1)
            self.assertNotIn("error", got[0], got[0])
            return got[0]["result"]

        outer = call(1, "tc_init", root=sb.ws, name="outer")["structuredContent"]["task_id"]
        self.assertEqual(call(2, "tc_save", root=sb.ws, title="one")["structuredContent"]
                         ["index"], 1)
        inner = call(3, "tc_init", root=store, name="inner")
        if inner["isError"]:
            return  # refusing a store as a workspace root is the other acceptable answer
        call(4, "tc_save", root=store, title="inner one")
        with open(os.path.join(sb.ws, "new.txt"), "w") as fh:
            fh.write("new\n")
        self.assertEqual(call(5, "tc_save", root=sb.ws, title="two")["structuredContent"]
                         ["index"], 2)
        call(6, "tc_restore", root=store, index=1, apply=True)
        step2 = os.path.join(store, "tasks", outer, "steps", "s0002.json")
        self.assertTrue(os.path.exists(step2), "a restore of the store-as-root deleted %s"
                        % step2)
        self.assertEqual(call(7, "tc_save", root=sb.ws, title="three")["structuredContent"]
                         ["index"], 3, "a step number was reused")


if __name__ == "__main__":
    unittest.main()
