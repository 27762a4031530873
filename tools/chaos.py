#!/usr/bin/env python3
"""Fault drill: SIGKILL in the middle of every kind of write, on a busy store.

    python3 tools/chaos.py                  # 30 rounds, a random seed
    python3 tools/chaos.py --rounds 60 --seed 7 --git

Each round edits the workspace, sends one writing call (save, capture,
restore, undo of a restore, compress, export, import, init) to a server with
its watcher on, often while a second server on the same store saves or
captures, and kills the first server with SIGKILL after a random delay
(from at once to a few hundred milliseconds). A fresh server then checks:

- tc_resume answers, with health ok;
- every JSON file of the store parses and every payload matches its name;
- the workspace is exactly as before the call or exactly at the restore's
  target (never a mix), and holds no temporary file of the server;
- every step tc_show lists previews with nothing unrestorable;
- with --git: HEAD, branches, tags and the user's index are untouched and
  `git fsck` is clean.

With --cancel the call is not killed but cancelled: after the same random
delay a notifications/cancelled names it, and the same checks run once the
server has answered a ping sent behind the cancel. The call must either
have finished (answered or not) or have left no trace: the workspace as
before, no journal pending.

Prints one line per round and exits 1 when any check failed; the workspace
is kept then (and with --keep). Standard library only; not part of the unit
test suite. The seed in use is printed so that a run can be replayed.
"""

import argparse
import hashlib
import json
import os
import queue
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import drill  # noqa: E402  (the drill's server client and file helpers)

FILES = ["src/m%d/f%03d.txt" % (i % 9, i) for i in range(200)] + [
    "blobs/b%d.bin" % i for i in range(4)]
OPS = ("save", "save", "capture", "restore", "restore", "undo", "compress", "export",
       "import", "init")


class Chaos:
    def __init__(self, args):
        self.args = args
        self.rng = random.Random(args.seed)
        self.base = tempfile.mkdtemp(prefix="tc-chaos-")
        self.root = os.path.join(self.base, "ws")
        self.out = os.path.join(self.base, "out")
        os.makedirs(self.root)
        os.makedirs(self.out)
        self.env = dict(os.environ, TC_WATCH="on", TC_WATCH_INTERVAL="0.1",
                        TC_DRIFT_MAX_WAIT="0.3", TC_GIT="on" if args.git else "off")
        for key in ("TC_STORE", "TC_SHA_REUSE", "TC_FULL_HASH"):
            self.env.pop(key, None)
        self.known = {}  # (task id, step) -> workspace snapshot, None when unknown
        self.task = None
        self.recovered = None
        self.problems = []

    # -- workspace ------------------------------------------------------------

    def content(self, rel, tag):
        if rel.startswith("blobs/"):
            return hashlib.sha256(tag.encode()).digest() * self.rng.randint(20000, 90000)
        return ("%s %s\n" % (rel, tag)).encode() * self.rng.randint(1, 400)

    def edit(self, tag):
        for rel in self.rng.sample(FILES, self.rng.randint(1, 25)):
            path = os.path.join(self.root, *rel.split("/"))
            if self.rng.random() < 0.15 and os.path.exists(path):
                os.remove(path)
            else:
                drill.write(self.root, rel, self.content(rel, tag))

    def snapshot(self):
        return drill.snapshot(self.root)

    def git_state(self):
        def out(*args):
            return drill.git(self.root, *args, check=False)
        index = os.path.join(self.root, ".git", "index")
        return (out("rev-parse", "HEAD"), out("symbolic-ref", "HEAD"),
                out("for-each-ref", "--format=%(refname) %(objectname)", "refs/heads",
                    "refs/tags"), drill.sha256_file(index))

    # -- servers ----------------------------------------------------------------

    def server(self):
        srv = drill.McpServer(self.env, self.base)
        srv.initialize()
        return srv

    def problem(self, label, text):
        self.problems.append("%s: %s" % (label, text))
        print("  PROBLEM %s: %s" % (label, text), flush=True)

    def setup(self):
        for rel in FILES:
            drill.write(self.root, rel, self.content(rel, "start"))
        if self.args.git:
            drill.write(self.root, ".gitignore", ".checkpoints/\n")
            env = drill.git_env()
            for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "start"]):
                subprocess.run(["git"] + args, cwd=self.root, env=env, check=True,
                               stdout=subprocess.DEVNULL)
            self.git_before = self.git_state()
        srv = self.server()
        srv.call("tc_init", root=self.root, name="chaos")
        step = srv.call("tc_save", root=self.root, title="start")
        self.task = step["task_id"]
        self.known[(self.task, step["index"])] = self.snapshot()
        return srv

    # -- one round --------------------------------------------------------------

    def arguments(self, op, number):
        args = {"root": self.root}
        if op == "save":
            return "tc_save", dict(args, title="round %d" % number), []
        if op == "capture":
            return "tc_capture", args, []
        if op == "restore":
            steps = [i for (t, i), snap in self.known.items() if t == self.task and snap]
            index = self.rng.choice(steps)
            return ("tc_restore", dict(args, index=index, apply=True),
                    [self.known[(self.task, index)]])
        if op == "undo" and self.recovered:
            return "tc_restore", dict(args, drift_id=self.recovered, apply=True), None
        if op == "compress":
            return "tc_compress", dict(args, keep_seconds=0, minimum=0, maximum=1), []
        if op == "export":
            return "tc_export", dict(args, to=self.out, history=self.rng.random() < 0.5), []
        if op == "import":
            packages = [os.path.join(self.out, n) for n in sorted(os.listdir(self.out))
                        if n.endswith("-handoff")]
            if packages:
                return "tc_import", dict(args, package=self.rng.choice(packages)), None
        if op == "init":
            return "tc_init", dict(args, name="again %d" % number), []
        return None

    def round(self, srv, number):
        self.edit("round %d" % number)
        op = self.rng.choice(OPS)
        call = self.arguments(op, number)
        if call is None:
            return srv
        tool, args, targets = call
        before = self.snapshot()
        other = self.server() if self.rng.random() < 0.5 else None
        helper = None
        if other is not None:
            helper = threading.Thread(target=self.busy, args=(other, number))
        request = srv.send("tools/call", {"name": tool, "arguments": args})
        if helper:
            helper.start()
        delay = self.rng.choice([0.0, self.rng.uniform(0, 0.01), self.rng.uniform(0, 0.06),
                                 self.rng.uniform(0, 0.3)])
        time.sleep(delay)
        reply = srv.poll_reply(request)
        if self.args.cancel:
            reply, label = self.cancel(srv, request, reply, number, op, delay)
        else:
            srv.kill()
            label = "round %d %s, killed after %.3f s%s" % (
                number, op, delay, " (it had answered)" if reply else "")
        if helper:
            helper.join()
            other.close()
        if not self.args.cancel:
            srv = self.server()
        self.check(srv, label, before, targets, op)
        if reply and "result" in reply and not reply["result"].get("isError"):
            recovered = (reply["result"].get("structuredContent") or {}).get("recovered")
            self.recovered = recovered or self.recovered
        print("%s %s" % ("FAIL" if any(p.startswith(label) for p in self.problems)
                         else "ok  ", label), flush=True)
        return srv

    def cancel(self, srv, request, reply, number, op, delay):
        """Cancel the request, then wait for a ping sent behind the cancel:
        (the call's reply if it came, the round's label)."""
        if reply is None:
            srv.send("notifications/cancelled", {"requestId": request, "reason": "chaos"},
                     notify=True)
        ping = srv.send("ping")
        while True:
            try:
                msg = srv.replies.get(timeout=drill.REPLY_TIMEOUT)
            except queue.Empty:
                msg = None
            if msg is None:
                self.problem("round %d %s" % (number, op), "no answer to a ping after the "
                             "cancel; stderr: %s" % srv.stderr_text()[-500:])
                break
            if msg.get("id") == request:
                reply = msg
            elif msg.get("id") == ping:
                break
        return reply, "round %d %s, cancelled after %.3f s%s" % (
            number, op, delay, " (it had answered)" if reply else "")

    def busy(self, other, number):
        try:
            if self.rng.random() < 0.5:
                other.call("tc_save", root=self.root, title="beside round %d" % number)
            else:
                other.call("tc_capture", root=self.root)
        except drill.DrillError as exc:
            if "closed" not in str(exc):
                self.problem("round %d, second server" % number, str(exc))

    # -- checks -----------------------------------------------------------------

    def check(self, srv, label, before, targets, op):
        try:
            resume = srv.call("tc_resume", root=self.root)
        except drill.DrillError as exc:
            self.problem(label, "tc_resume: %s" % exc)
            return
        if not resume["health"]["ok"]:
            self.problem(label, "health: %s" % resume["health"]["errors"])
        bad = store_problems(os.path.join(self.root, ".checkpoints"))
        if bad:
            self.problem(label, "store: %s" % bad[:3])
        try:
            srv.call("tc_capture", root=self.root)  # a writing call finishes any rollback
        except drill.DrillError as exc:
            self.problem(label, "tc_capture after the kill: %s" % exc)
        now = self.snapshot()
        if targets is not None and now != before and all(now != t for t in targets):
            self.problem(label, "the workspace is a mix: %s" % drill.snapshot_diff(
                before, now)[:5])
        leftovers = [p for p in now if "/.tc-" in "/" + p or ".tmp-" in p]
        if leftovers:
            self.problem(label, "temporary files left in the workspace: %s" % leftovers[:3])
        if self.args.git:
            if self.git_state() != self.git_before:
                self.problem(label, "the user's HEAD, refs or index changed")
            fsck = subprocess.run(["git", "fsck", "--no-progress", "--no-dangling"],
                                  cwd=self.root, env=drill.git_env(), capture_output=True)
            if fsck.returncode != 0 or fsck.stdout.strip():
                self.problem(label, "git fsck: %s" % (fsck.stdout or fsck.stderr)[:300])
        try:
            shown = srv.call("tc_show", root=self.root, limit=200)
        except drill.DrillError as exc:
            self.problem(label, "tc_show: %s" % exc)
            return
        self.learn(shown, before if op == "save" else None, op)
        for step in shown["steps"]:
            try:
                plan = srv.call("tc_restore", root=self.root, index=step["index"])["plan"]
            except drill.DrillError as exc:
                self.problem(label, "preview of step %d: %s" % (step["index"], exc))
                continue
            if plan["unrestorable"]:
                self.problem(label, "step %d has unrestorable files: %s"
                             % (step["index"], plan["unrestorable"][:2]))
        try:
            step = srv.call("tc_save", root=self.root, title="after " + label)
        except drill.DrillError as exc:
            self.problem(label, "tc_save after the kill: %s" % exc)
            return
        self.task = step["task_id"]
        self.known[(self.task, step["index"])] = self.snapshot()

    def learn(self, shown, content, op):
        """Steps not seen before: a killed save's step holds the files as they
        were (saves do not change the workspace); any other is unknown."""
        self.task = shown["task_id"]
        if op == "import":  # an imported task may reuse the id: forget its steps
            for key in [k for k in self.known if k[0] == self.task]:
                self.known[key] = None
        for step in shown["steps"]:
            self.known.setdefault((self.task, step["index"]), content)

    def run(self):
        print("seed %d, workspace %s" % (self.args.seed, self.base), flush=True)
        srv = self.setup()
        try:
            for number in range(self.args.rounds):
                srv = self.round(srv, number)
        finally:
            srv.close()
        if self.args.cancel:
            print("cancelled calls (server.log): %s" % self.cancel_outcomes())
        print("%d rounds, %d problems" % (self.args.rounds, len(self.problems)))
        if self.problems or self.args.keep:
            print("kept %s" % self.base)
        else:
            shutil.rmtree(self.base, ignore_errors=True)
        return 1 if self.problems else 0


    def cancel_outcomes(self):
        counts = {"stopped": 0, "had finished": 0, "before it started": 0}
        try:
            with open(os.path.join(self.root, ".checkpoints", "server.log"),
                      encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    for outcome in counts:
                        if "was cancelled" in line and outcome in line:
                            counts[outcome] += 1
        except OSError:
            pass
        return ", ".join("%d %s" % (n, outcome) for outcome, n in counts.items())


def store_problems(store):
    """Store JSON files that do not parse, payloads whose bytes miss their name."""
    problems = []
    for dirpath, _dirs, names in os.walk(store):
        for name in names:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, store)
            if name.endswith(".json"):
                try:
                    with open(full, "rb") as fh:
                        json.loads(fh.read().decode("utf-8"))
                except ValueError:
                    problems.append("%s does not parse" % rel)
            elif rel.startswith("payload" + os.sep) and len(name) == 64:
                if drill.sha256_file(full) != name:
                    problems.append("%s does not match its name" % rel)
    return problems


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--cancel", action="store_true",
                        help="cancel the call instead of killing the server")
    parser.add_argument("--git", action="store_true", help="run in a git repository")
    parser.add_argument("--keep", action="store_true", help="keep the workspace")
    args = parser.parse_args(argv)
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1 << 30)
    return Chaos(args).run()


if __name__ == "__main__":
    sys.exit(main())
