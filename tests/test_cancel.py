"""notifications/cancelled: a cancelled tool call stops and is not answered.

Over stdio, a call is held in the store-lock wait by a lock this test takes
on the real state.lock, so the cancel is known to reach a running call (the
server's descriptor on state.lock shows it waiting). In process, the cancel
is set from inside the real per-file work of a save, restore, import and
export, to show that each one stops part-way and leaves nothing recorded,
with what a restore or an import had already written rolled back.
"""

import json
import os
import sys
import threading
import time
import unittest

import support
from support import WorkspaceTest, snapshot, store_problems, write

sys.path.insert(0, support.SCRIPTS)
import tc  # noqa: E402

try:
    import fcntl
except ImportError:  # Windows: the lock tests below skip without /proc anyway
    fcntl = None

HAS_PROC_FD = os.path.isdir("/proc/self/fd")


def request_line(msg_id, method, params=None):
    msg = {"jsonrpc": "2.0", "id": msg_id, "method": method}
    if params is not None:
        msg["params"] = params
    return json.dumps(msg) + "\n"


def tool_line(msg_id, name, **arguments):
    return request_line(msg_id, "tools/call", {"name": name, "arguments": arguments})


def cancel_line(request_id):
    return json.dumps({"jsonrpc": "2.0", "method": "notifications/cancelled",
                       "params": {"requestId": request_id, "reason": "the user stopped it"}}) + "\n"


@unittest.skipUnless(HAS_PROC_FD, "needs /proc to see the server wait for the lock")
class CancelOverStdioTest(WorkspaceTest):

    def setUp(self):
        super().setUp()
        self.srv = self.server()
        self.write("a.txt", "1\n")
        self.srv.ok("tc_init", root=self.root, name="cancel")
        self.assertEqual(self.srv.ok("tc_save", root=self.root, title="one")["index"], 1)
        self.write("a.txt", "2\n")

    def hold_store_lock(self):
        """The store lock, held by this process. It is let go after 10 s in
        any case, so a server that ignores the cancel answers late (and the
        test fails on what it reads) instead of the test hanging."""
        fd = os.open(os.path.join(self.store, "state.lock"), os.O_RDWR)
        fcntl.flock(fd, fcntl.LOCK_EX)
        self.addCleanup(os.close, fd)
        timer = threading.Timer(10, fcntl.flock, (fd, fcntl.LOCK_UN))
        timer.start()
        self.addCleanup(timer.join)
        self.addCleanup(timer.cancel)
        return fd

    def wait_until_waiting_for_the_lock(self):
        fds = "/proc/%d/fd" % self.srv.proc.pid
        lock = os.path.join(self.store, "state.lock")
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            for name in os.listdir(fds):
                try:
                    if os.readlink(os.path.join(fds, name)) == lock:
                        return
                except OSError:
                    continue
            time.sleep(0.01)
        self.fail("the server never waited for the store lock")

    def titles(self):
        return [s["title"] for s in self.srv.ok("tc_show", root=self.root)["steps"]]

    def log(self):
        with open(os.path.join(self.store, "server.log"), encoding="utf-8") as fh:
            return fh.read()

    def test_a_running_call_that_is_cancelled_stops_and_is_not_answered(self):
        fd = self.hold_store_lock()
        self.srv.send_raw(tool_line(100, "tc_save", root=self.root, title="two").encode())
        self.wait_until_waiting_for_the_lock()
        self.srv.send_raw((cancel_line(100) + request_line(101, "tools/list")).encode())
        reply = self.srv.read_line()  # the save stops waiting; no lock is released for it
        self.assertEqual(reply["id"], 101)  # answered in turn, after the save
        self.assertIn("tools", reply["result"])
        fcntl.flock(fd, fcntl.LOCK_UN)
        self.assertEqual(self.titles(), ["one"])
        self.assertIn("'tc_save' (id 100) was cancelled; it stopped", self.log())
        self.assertEqual(self.srv.ok("tc_save", root=self.root, title="two")["index"], 2)

    def test_a_cancel_spelt_with_json_escapes_stops_the_call(self):
        # The same JSON strings as "notifications/cancelled" and "ping", as
        # some encoders write them ("\\/" is PHP's default).
        fd = self.hold_store_lock()
        self.srv.send_raw(tool_line(110, "tc_save", root=self.root, title="two").encode())
        self.wait_until_waiting_for_the_lock()
        self.srv.send_raw(b'{"jsonrpc":"2.0","id":111,"method":"p\\u0069ng"}\n')
        self.assertEqual(self.srv.read_line(), {"jsonrpc": "2.0", "id": 111, "result": {}})
        self.srv.send_raw(b'{"jsonrpc":"2.0","method":"notifications\\/cancelled",'
                          b'"params":{"requestId":110}}\n' + request_line(112, "ping").encode())
        self.assertEqual(self.srv.read_line(), {"jsonrpc": "2.0", "id": 112, "result": {}})
        fcntl.flock(fd, fcntl.LOCK_UN)
        self.assertEqual(self.titles(), ["one"])
        self.assertIn("'tc_save' (id 110) was cancelled; it stopped", self.log())

    def test_a_ping_is_answered_while_a_call_runs(self):
        fd = self.hold_store_lock()
        self.srv.send_raw(tool_line(500, "tc_save", root=self.root, title="two").encode())
        self.wait_until_waiting_for_the_lock()
        self.srv.send_raw(request_line(501, "ping").encode())
        self.assertEqual(self.srv.read_line(), {"jsonrpc": "2.0", "id": 501, "result": {}})
        fcntl.flock(fd, fcntl.LOCK_UN)
        reply = self.srv.read_line()
        self.assertEqual(reply["id"], 500)
        self.assertEqual(reply["result"]["structuredContent"]["index"], 2)
        self.assertEqual(self.titles(), ["one", "two"])

    def test_a_cancel_behind_thousands_of_pings_still_stops_the_call(self):
        # The client writes everything before it reads: more answers than the
        # stdout pipe holds must not keep the server from reading on.
        fd = self.hold_store_lock()
        self.srv.send_raw(tool_line(300, "tc_save", root=self.root, title="two").encode())
        self.wait_until_waiting_for_the_lock()
        pings = "".join(request_line(1000 + n, "ping") for n in range(5000))
        writer = threading.Thread(target=self.srv.send_raw,
                                  args=((pings + cancel_line(300)).encode(),), daemon=True)
        writer.start()
        writer.join(8)
        self.assertFalse(writer.is_alive(), "the server stopped reading its input")
        answered = [self.srv.read_line()["id"] for _ in range(5000)]
        self.assertEqual(sorted(answered), list(range(1000, 6000)))
        fcntl.flock(fd, fcntl.LOCK_UN)
        self.assertEqual(self.titles(), ["one"])

    def test_a_cancel_behind_a_request_over_the_read_ahead_limit_still_stops_the_call(self):
        fd = self.hold_store_lock()
        self.srv.send_raw(tool_line(400, "tc_save", root=self.root, title="two").encode())
        self.wait_until_waiting_for_the_lock()
        big = request_line(401, "ping", {"pad": "x" * (5 << 20)})  # over the 4 MiB read-ahead
        self.srv.send_raw((big + cancel_line(400) + request_line(402, "ping")).encode())
        self.assertEqual(self.srv.read_line()["id"], 401)
        self.assertEqual(self.srv.read_line()["id"], 402)
        fcntl.flock(fd, fcntl.LOCK_UN)
        self.assertEqual(self.titles(), ["one"])

    def test_a_queued_call_that_is_cancelled_never_runs_and_its_id_can_be_used_again(self):
        fd = self.hold_store_lock()
        self.srv.send_raw((tool_line(200, "tc_save", root=self.root, title="two")
                           + tool_line(201, "tc_save", root=self.root, title="three")
                           + cancel_line(201) + request_line(202, "ping")).encode())
        self.wait_until_waiting_for_the_lock()
        time.sleep(0.3)  # the reader thread has long taken in every line by now
        fcntl.flock(fd, fcntl.LOCK_UN)
        first = self.srv.read_line()
        self.assertEqual(first["id"], 200)
        self.assertEqual(first["result"]["structuredContent"]["index"], 2)
        self.assertEqual(self.srv.read_line(), {"jsonrpc": "2.0", "id": 202, "result": {}})
        self.assertEqual(self.titles(), ["one", "two"])
        self.assertIn("'tc_save' (id 201) was cancelled before it started", self.log())
        # A cancel reaches only requests before it: a later one with the same id runs.
        self.write("a.txt", "3\n")
        self.srv.send_raw(tool_line(201, "tc_save", root=self.root, title="three").encode())
        again = self.srv.read_line()
        self.assertEqual(again["id"], 201)
        self.assertEqual(again["result"]["structuredContent"]["index"], 3)

    def test_cancels_of_answered_unknown_or_malformed_requests_change_nothing(self):
        self.assertEqual(self.srv.ok("tc_save", root=self.root, title="two")["index"], 2)
        answered = self.srv._id
        noise = [cancel_line(answered), cancel_line("never-sent"), cancel_line(None),
                 json.dumps({"jsonrpc": "2.0", "method": "notifications/cancelled",
                             "params": {"requestId": [1]}}) + "\n",
                 json.dumps({"jsonrpc": "2.0", "method": "notifications/cancelled"}) + "\n",
                 '{"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {\n']
        self.srv.send_raw("".join(noise).encode())
        self.assertEqual(self.srv.read_line()["error"]["code"], -32700)  # the cut line
        self.write("a.txt", "3\n")
        self.assertEqual(self.srv.ok("tc_save", root=self.root, title="three")["index"], 3)


class Trigger:
    """Sets the call's cancel event from inside the n-th call of a real
    function, which still runs; restores the original on cleanup."""

    def __init__(self, test, owner, name, after):
        self.event = threading.Event()
        self.calls = 0
        original = getattr(owner, name)

        def wrapped(*args, **kwargs):
            self.calls += 1
            if self.calls == after:
                self.event.set()
            return original(*args, **kwargs)

        setattr(owner, name, wrapped)
        test.addCleanup(setattr, owner, name, original)


class CancelledMidwayTest(WorkspaceTest):

    FILES = 30

    def setUp(self):
        super().setUp()
        self.cp = tc.Checkpoints(tc.Config(watch=False, git=False))
        for n in range(self.FILES):
            self.write("src/f%02d.txt" % n, "first %d\n" % n)
        self.task = self.cp.init(self.root, "midway")["task_id"]
        self.cp.save(self.root, "one")

    def change_every_file(self, text):
        for n in range(self.FILES):
            self.write("src/f%02d.txt" % n, "%s %d\n" % (text, n))

    def journals(self):
        directory = os.path.join(self.store, "journal")
        return os.listdir(directory) if os.path.isdir(directory) else []

    def payload_names(self, store=None):
        payload = os.path.join(store or self.store, "payload")
        return sorted(name for _dir, _dirs, names in os.walk(payload) for name in names)

    def test_a_save_for_another_task_that_is_cancelled_leaves_the_active_task_alone(self):
        first = self.task
        second = self.cp.init(self.root, "second")["task_id"]
        self.change_every_file("second")
        event = threading.Event()
        event.set()
        with tc.cancellable(event), self.assertRaises(tc.Cancelled):
            self.cp.save(self.root, "two", task_id=first)
        resumed = self.cp.resume(self.root)
        self.assertEqual(resumed["task_id"], second)
        self.assertEqual(self.cp.show(self.root, task_id=first)["status"], "suspended")

    def test_a_save_stops_between_files_and_records_nothing(self):
        self.change_every_file("second")
        stored = self.payload_names()
        trigger = Trigger(self, tc.PayloadStore, "put_file", after=5)
        with tc.cancellable(trigger.event), self.assertRaises(tc.Cancelled):
            self.cp.save(self.root, "two")
        self.assertLess(trigger.calls, self.FILES, "the save read every file after the cancel")
        self.assertEqual(self.payload_names(), stored, "content stored before the cancel is kept")
        show = self.cp.show(self.root)
        self.assertEqual([s["title"] for s in show["steps"]], ["one"])
        self.assertEqual(self.cp.save(self.root, "two")["index"], 2)
        self.assertEqual(store_problems(self.store), [])

    def test_an_init_stops_part_way_and_leaves_no_task(self):
        other = os.path.join(self.tmp, "other")
        for n in range(self.FILES):
            write(other, "f%02d.txt" % n, "other %d\n" % n)
        trigger = Trigger(self, tc.PayloadStore, "put_file", after=5)
        with tc.cancellable(trigger.event), self.assertRaises(tc.Cancelled):
            self.cp.init(other, "never")
        tasks = os.path.join(other, ".checkpoints", "tasks")
        self.assertEqual(os.listdir(tasks) if os.path.isdir(tasks) else [], [])
        with self.assertRaises(tc.NotFound):
            self.cp.resume(other)
        self.assertTrue(self.cp.init(other, "again")["task_id"].startswith("again-"))

    def test_a_restore_stops_part_way_and_what_it_wrote_is_rolled_back(self):
        self.change_every_file("second")
        self.cp.save(self.root, "two")
        before = snapshot(self.root)
        drifts = self.cp.show(self.root, include_drift=True).get("drifts")
        trigger = Trigger(self, tc.PayloadStore, "write_over", after=5)
        with tc.cancellable(trigger.event), self.assertRaises(tc.CheckpointError) as caught:
            self.cp.restore(self.root, index=1, apply=True)
        self.assertIn("nothing was changed: cancelled by the client", str(caught.exception))
        self.assertGreaterEqual(trigger.calls, 5, "the cancel came before any file was written")
        self.assertLess(trigger.calls, self.FILES)
        self.assertEqual(snapshot(self.root), before)
        self.assertEqual(self.cp.resume(self.root)["head"], 2)
        self.assertEqual(self.cp.show(self.root, include_drift=True).get("drifts"), drifts)
        self.assertEqual(self.journals(), [])
        self.cp.restore(self.root, index=1, apply=True)
        self.assertEqual(self.read("src/f07.txt"), b"first 7\n")

    def test_an_import_stops_part_way_and_leaves_neither_files_nor_a_task(self):
        out = os.path.join(self.tmp, "out")
        os.makedirs(out)
        package = self.cp.export(self.root, out)["path"]
        fresh = os.path.join(self.tmp, "fresh")
        os.makedirs(fresh)
        trigger = Trigger(self, tc.PayloadStore, "place_stored", after=5)
        with tc.cancellable(trigger.event), self.assertRaises(tc.CheckpointError) as caught:
            self.cp.import_package(fresh, package)
        self.assertIn("cancelled by the client", str(caught.exception))
        self.assertEqual(snapshot(fresh), {})
        self.assertEqual(self.payload_names(os.path.join(fresh, ".checkpoints")), [])
        self.assertEqual(self.cp.import_package(fresh, package)["task_id"], self.task)
        self.assertEqual(len(snapshot(fresh)), self.FILES)

    def test_an_import_cancelled_while_it_stores_the_history_keeps_none_of_it(self):
        self.change_every_file("second")
        self.cp.save(self.root, "two")
        out = os.path.join(self.tmp, "out")
        os.makedirs(out)
        package = self.cp.export(self.root, out, history=True)["path"]
        fresh = os.path.join(self.tmp, "fresh")
        os.makedirs(fresh)
        write(fresh, "notes.txt", "kept\n")  # stored by the import's first snapshot
        trigger = Trigger(self, tc.PayloadStore, "put_file", after=3)
        with tc.cancellable(trigger.event), self.assertRaises(tc.Cancelled):
            self.cp.import_package(fresh, package)
        self.assertGreaterEqual(trigger.calls, 3, "the cancel came before the history")
        self.assertEqual({rel: data for rel, (data, _mode) in snapshot(fresh).items()},
                         {"notes.txt": b"kept\n"})
        self.assertEqual(self.payload_names(os.path.join(fresh, ".checkpoints")), [])

    def test_an_export_stops_part_way_and_leaves_no_package(self):
        out = os.path.join(self.tmp, "out")
        os.makedirs(out)
        trigger = Trigger(self, tc, "copy_tree_file", after=5)
        with tc.cancellable(trigger.event), self.assertRaises(tc.Cancelled):
            self.cp.export(self.root, out)
        self.assertEqual(os.listdir(out), [])
        self.assertTrue(self.cp.export(self.root, out)["path"].startswith(out))

    def test_other_threads_and_calls_outside_a_cancellable_block_are_not_stopped(self):
        event = threading.Event()
        event.set()
        self.change_every_file("second")
        done = []
        worker = threading.Thread(target=lambda: done.append(self.cp.save(self.root, "two")))
        with tc.cancellable(event):
            worker.start()
            worker.join()
        self.assertEqual(done[0]["index"], 2)
        write(self.root, "src/f00.txt", "third\n")
        self.assertEqual(self.cp.save(self.root, "three")["index"], 3)


if __name__ == "__main__":
    unittest.main()
