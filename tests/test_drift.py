"""The drift layer through the real server: the watcher, tc_capture, restore
by drift id, and tc_compress.

The watcher tests run with a one-second interval and a three-second quiet
period ceiling, and poll for what they expect instead of sleeping a fixed time;
QuietPeriodTest drives the watcher's tick in-process, with its own clock.
"""

import hashlib
import json
import os
import re
import shutil
import sys
import threading
import time
import unittest

from support import (SCRIPTS, WorkspaceTest, can_symlink, drift_key, drift_paths, paths_of, snapshot,
                     stored_shas, tree_listing, unnamed_payloads)

sys.path.insert(0, SCRIPTS)
import tc  # noqa: E402

# Short ticks keep the suite fast; the behaviour is the same at any interval.
TICK = 0.25
WATCH_ON = {"TC_WATCH": "on", "TC_WATCH_INTERVAL": str(TICK), "TC_DRIFT_MAX_WAIT": "1"}
WATCH_OFF = {"TC_WATCH": "off", "TC_WATCH_INTERVAL": str(TICK), "TC_DRIFT_MAX_WAIT": "1"}
DRIFT_ID = re.compile(r"^d\d{4,}$")
CAPTURE_FIELDS = {"captured", "waiting", "drift_id", "partial", "reads", "skipped_paths"}
COMPRESS_FIELDS = {"converted", "eligible", "already_gone", "bytes_freed",
                   "keep_seconds", "minimum", "maximum"}


def wait_for(predicate, timeout, interval=0.2):
    """Call predicate until it returns something true or timeout seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(interval)


def all_drifts(srv, root):
    shown = srv.ok("tc_show", root=root, include_drift=True, limit=200)
    return shown["drifts"]


def find_drift(srv, root, drift_id):
    for record in all_drifts(srv, root):
        if drift_key(record) == drift_id:
            return record
    raise AssertionError("drift %s not listed by tc_show include_drift" % drift_id)


def read_file(path):
    with open(path, "rb") as fh:
        return fh.read()


def binary_blob(seed, size):
    """Deterministic bytes covering every byte value."""
    out = bytearray(range(256))
    state = seed
    while len(out) < size:
        state = (state * 1103515245 + 12345) & 0x7FFFFFFF
        out += state.to_bytes(4, "little")
    return bytes(out[:size])


class WatcherTest(WorkspaceTest):
    """The background thread records changes nobody told the server about."""

    def start_task(self, env):
        srv = self.server(env=env)
        self.write("a.txt", "first version\n")
        self.write("b.txt", "to be deleted\n")
        self.write("sub/keep.txt", "unchanged\n")
        init = srv.ok("tc_init", root=self.root, name="watched", goal="watch files")
        srv.ok("tc_save", root=self.root, title="baseline", conclusion="c", next="n")
        return srv, init["task_id"]

    def drift_files(self, task_id):
        return sorted(os.listdir(os.path.join(self.store, "tasks", task_id, "drifts")))

    def test_a_restarted_server_records_from_the_first_call_of_a_session(self):
        srv, task_id = self.start_task(WATCH_ON)
        srv.close()
        again = self.server(env=WATCH_ON)  # started elsewhere, no TC_STORE
        again.ok("tc_resume", root=self.root)
        before = self.drift_files(task_id)
        self.write("a.txt", "edited after the resume, before any save\n")
        self.assertTrue(wait_for(lambda: self.drift_files(task_id) != before, 8),
                        "the watcher recorded nothing after tc_resume")
        new = [d for d in all_drifts(again, self.root) if "%s.json" % drift_key(d) not in before]
        self.assertIn("a.txt", {p for d in new for p in drift_paths(d, "modified")})

    def test_a_server_started_in_the_workspace_records_before_any_call(self):
        srv, task_id = self.start_task(WATCH_ON)
        srv.close()
        self.server(env=WATCH_ON, cwd=self.root)
        before = self.drift_files(task_id)
        wait_for(lambda: False, 3 * TICK)  # its first walk sees the workspace as stored
        self.write("a.txt", "edited with no tool call at all\n")
        self.assertTrue(wait_for(lambda: self.drift_files(task_id) != before, 8),
                        "a server started in the workspace did not watch it")

    def test_a_server_started_in_a_deleted_folder_still_serves(self):
        gone = os.path.join(self.tmp, "gone")
        os.makedirs(gone)
        command = ["sh", "-c", 'cd "$1" && rmdir "$1" && exec "$2" -S "$3"', "sh", gone,
                   sys.executable, os.path.join(SCRIPTS, "tc_mcp.py")]
        srv = self.server(env=WATCH_ON, command=command)  # answers its initialize
        self.assertEqual(srv.request("ping")["result"], {})
        self.write("a.txt", "a\n")
        self.assertTrue(srv.ok("tc_init", root=self.root, name="from nowhere")["task_id"])

    def test_plain_file_writes_become_a_drift_record(self):
        srv, _ = self.start_task(WATCH_ON)
        known = {drift_key(d) for d in all_drifts(srv, self.root)}
        # Plain writes, no tool call at all.
        with open(os.path.join(self.root, "a.txt"), "wb") as fh:
            fh.write(b"second version, longer\n")
        with open(os.path.join(self.root, "new.txt"), "wb") as fh:
            fh.write(b"fresh\n")
        os.remove(os.path.join(self.root, "b.txt"))

        def seen():
            new = [d for d in all_drifts(srv, self.root) if drift_key(d) not in known]
            changes = {k: set() for k in ("added", "modified", "deleted")}
            for record in new:
                for kind in changes:
                    changes[kind].update(drift_paths(record, kind))
            if ("new.txt" in changes["added"] and "a.txt" in changes["modified"]
                    and "b.txt" in changes["deleted"]):
                return new, changes
            return None

        found = wait_for(seen, 8)
        self.assertTrue(found, "no drift record for plain edits within 8 s: %r"
                        % all_drifts(srv, self.root))
        new, changes = found
        for record in new:
            self.assertTrue(DRIFT_ID.match(drift_key(record)), record)
            self.assertNotIn("sub/keep.txt", drift_paths(record, "modified"))
        self.assertEqual(changes["added"], {"new.txt"})
        self.assertEqual(changes["modified"], {"a.txt"})
        self.assertEqual(changes["deleted"], {"b.txt"})

    def test_file_written_continuously_yields_partial_record(self):
        srv, _ = self.start_task(WATCH_ON)
        known = {drift_key(d) for d in all_drifts(srv, self.root)}
        path = os.path.join(self.root, "grow.log")
        stop = threading.Event()

        def writer():
            end = time.monotonic() + 6.5
            n = 0
            while not stop.is_set() and time.monotonic() < end:
                with open(path, "ab") as fh:
                    fh.write(b"line %d\n" % n)
                n += 1
                stop.wait(TICK / 3)

        thread = threading.Thread(target=writer, daemon=True)
        thread.start()
        try:
            def partial_record():
                for record in all_drifts(srv, self.root):
                    if drift_key(record) not in known and record.get("partial") is True:
                        return record
                return None
            record = wait_for(partial_record, 8, interval=0.25)
        finally:
            stop.set()
            thread.join()
        self.assertTrue(record, "no partial drift record while a file kept changing: %r"
                        % all_drifts(srv, self.root))
        self.assertIn("grow.log", drift_paths(record, "added") + drift_paths(record, "modified"))

    def test_watch_off_records_nothing_without_a_call(self):
        srv, _ = self.start_task(WATCH_OFF)
        before = all_drifts(srv, self.root)
        self.write("a.txt", "edited while nobody watches\n")
        time.sleep(TICK * 5)  # five ticks of the interval the watcher would use
        self.assertEqual(all_drifts(srv, self.root), before)
        # The change was there to be seen: an explicit capture records it.
        cap = srv.ok("tc_capture", root=self.root)
        self.assertTrue(cap["captured"], cap)
        self.assertEqual(drift_paths(find_drift(srv, self.root, cap["drift_id"]), "modified"),
                         ["a.txt"])

    def test_failing_tick_is_logged_once_and_server_survives(self):
        srv, task_id = self.start_task(WATCH_ON)
        drifts_dir = os.path.join(self.store, "tasks", task_id, "drifts")
        if os.path.isdir(drifts_dir):
            shutil.rmtree(drifts_dir)
        with open(drifts_dir, "wb") as fh:
            fh.write(b"not a directory\n")
        log_path = os.path.join(self.store, "server.log")

        def log_lines():
            text = srv.stderr
            if os.path.exists(log_path):
                with open(log_path, "rb") as fh:
                    text += "\n" + fh.read().decode("utf-8", "replace")
            return [line for line in text.splitlines() if line.strip()]

        baseline = len(log_lines())
        self.write("a.txt", "edited, but the store cannot take a drift\n")
        problem = re.compile(r"error|fail|errno|not a directory|exists|exception|cannot", re.I)

        def first_failure():
            new = [line for line in log_lines()[baseline:] if problem.search(line)]
            return new[0] if new else None

        line = wait_for(first_failure, 8)
        self.assertTrue(line, "no failure logged for a watcher tick that cannot write; log:\n%s"
                        % "\n".join(log_lines()))
        time.sleep(TICK)  # let a multi-line report finish
        settled = len(log_lines())
        time.sleep(TICK * 5)  # about five more ticks that fail the same way
        reply = srv.request("ping")
        self.assertEqual(reply.get("result"), {}, reply)
        self.assertIsNone(srv.proc.poll(), "server died")
        names = [t["name"] for t in srv.request("tools/list")["result"]["tools"]]
        self.assertIn("tc_capture", names)
        lines = log_lines()
        signature = re.sub(r"[\d:.,-]+", "#", line)
        repeats = [x for x in lines if re.sub(r"[\d:.,-]+", "#", x) == signature]
        self.assertEqual(len(repeats), 1, "failure logged %d times:\n%s"
                         % (len(repeats), "\n".join(lines)))
        again = [x for x in lines[settled:] if problem.search(x)]
        self.assertEqual(again, [], "failure logged again on later ticks:\n%s" % "\n".join(lines))


class CaptureTest(WorkspaceTest):
    """tc_capture, the drift attached by tc_save, and drift id validation."""

    def setUp(self):
        super().setUp()
        self.srv = self.server(env=WATCH_OFF)
        self.write("a.txt", "alpha\n")
        self.write("b.txt", "beta\n")
        self.write("c/d.txt", "delta\n")
        self.task_id = self.srv.ok("tc_init", root=self.root, name="cap", goal="g")["task_id"]
        self.srv.ok("tc_save", root=self.root, title="baseline", conclusion="c", next="n")

    def test_capture_reports_added_modified_deleted(self):
        nothing = self.srv.ok("tc_capture", root=self.root)
        self.assertEqual(set(nothing) & CAPTURE_FIELDS, CAPTURE_FIELDS, nothing)
        self.assertFalse(nothing["captured"], nothing)
        self.assertIsNone(nothing["drift_id"], nothing)

        self.write("a.txt", "alpha, changed\n")
        os.remove(os.path.join(self.root, "b.txt"))
        self.write("e/new.txt", "new file\n")
        linked = can_symlink()  # not every Windows user may make one
        if linked:
            os.symlink("a.txt", os.path.join(self.root, "link"))
        cap = self.srv.ok("tc_capture", root=self.root)
        self.assertEqual(set(cap) & CAPTURE_FIELDS, CAPTURE_FIELDS, cap)
        self.assertIs(cap["captured"], True, cap)
        self.assertIs(cap["waiting"], False, cap)
        self.assertIs(cap["partial"], False, cap)
        self.assertTrue(DRIFT_ID.match(cap["drift_id"] or ""), cap)
        self.assertIsInstance(cap["reads"], int)
        self.assertGreaterEqual(cap["reads"], 2, cap)  # a.txt and e/new.txt at least
        self.assertIsInstance(cap["skipped_paths"], list)
        if linked:
            self.assertIn("link", json.dumps(cap["skipped_paths"]), cap)

        record = find_drift(self.srv, self.root, cap["drift_id"])
        self.assertEqual(drift_paths(record, "added"), ["e/new.txt"])
        self.assertEqual(drift_paths(record, "modified"), ["a.txt"])
        self.assertEqual(drift_paths(record, "deleted"), ["b.txt"])

        again = self.srv.ok("tc_capture", root=self.root)
        self.assertFalse(again["captured"], again)
        self.assertIsNone(again["drift_id"], again)

    def test_save_attaches_unrecorded_changes_as_a_drift_first(self):
        before = {drift_key(d) for d in all_drifts(self.srv, self.root)}
        self.write("a.txt", "alpha, edited before the save\n")
        self.write("c/new.txt", "added\n")
        saved = self.srv.ok("tc_save", root=self.root, title="second", conclusion="c2", next="n2")
        self.assertEqual(saved["index"], 2)
        new = [d for d in all_drifts(self.srv, self.root) if drift_key(d) not in before]
        self.assertEqual(len(new), 1, new)
        self.assertEqual(drift_paths(new[0], "modified"), ["a.txt"])
        self.assertEqual(drift_paths(new[0], "added"), ["c/new.txt"])
        # Nothing new on disk: the next save attaches no drift.
        count = len(all_drifts(self.srv, self.root))
        self.srv.ok("tc_save", root=self.root, title="third", conclusion="c3", next="n3")
        self.assertEqual(len(all_drifts(self.srv, self.root)), count)

    def test_malformed_and_unknown_drift_ids_are_refused(self):
        self.write("a.txt", "unsaved edit\n")
        before = snapshot(self.root)
        listing = tree_listing(self.root)
        drifts_before = all_drifts(self.srv, self.root)
        for bad in ("x1", "d12a", "../d0001", "d0001/../d0002", ""):
            for apply in (False, True):
                res = self.srv.call("tc_restore", root=self.root, drift_id=bad, apply=apply)
                self.assertTrue(res.is_error, (bad, res))
                self.assertNotIn("Traceback", res.text)
        res = self.srv.call("tc_restore", root=self.root, drift_id="d9999", apply=True)
        self.assertTrue(res.is_error, res)
        self.assertIn("d9999", res.text)
        self.assertEqual(len(res.text.strip().splitlines()), 1, res.text)
        self.assertEqual(snapshot(self.root), before)
        self.assertEqual([p for p in tree_listing(self.root) if not p[0].startswith(".checkpoints")],
                         [p for p in listing if not p[0].startswith(".checkpoints")])
        self.assertEqual(all_drifts(self.srv, self.root), drifts_before)


class DriftRestoreTest(WorkspaceTest):

    def test_restore_to_drift_and_undo_are_byte_exact(self):
        srv = self.server(env=WATCH_OFF)
        self.write("a.txt", "one\r\ntwo\n")
        self.write("bin.dat", binary_blob(1, 70000))
        self.write("sub/c.txt", "c\n")
        self.write("run.sh", "#!/bin/sh\necho hi\n", mode=0o755)
        srv.ok("tc_init", root=self.root, name="drift-restore", goal="g")
        srv.ok("tc_save", root=self.root, title="s1", conclusion="c", next="n")

        self.write("a.txt", "one\r\ntwo\nthree\n")
        self.write("bin.dat", binary_blob(2, 65000))
        self.write("sub/new.txt", "")
        state2 = snapshot(self.root)
        drift = srv.ok("tc_capture", root=self.root)["drift_id"]
        self.assertTrue(DRIFT_ID.match(drift or ""), drift)

        self.write("a.txt", "completely different\n")
        os.remove(os.path.join(self.root, "sub", "c.txt"))
        self.write("extra.txt", "only in the latest state\n")
        self.write("bin.dat", binary_blob(3, 80000))
        state3 = snapshot(self.root)

        preview = srv.ok("tc_restore", root=self.root, drift_id=drift, apply=False)
        self.assertIs(preview["applied"], False)
        self.assertEqual(snapshot(self.root), state3, "preview touched the workspace")
        plan = preview["plan"]
        for key in ("to_delete", "to_write", "to_replace", "unrestorable"):
            self.assertIn(key, plan)
        self.assertIn("extra.txt", paths_of(plan["to_delete"]))
        self.assertIn("sub/c.txt", paths_of(plan["to_write"]))
        self.assertTrue({"a.txt", "bin.dat"} <= paths_of(plan["to_replace"]), plan)
        self.assertNotIn("run.sh", paths_of(plan["to_replace"]) | paths_of(plan["to_write"]))

        done = srv.ok("tc_restore", root=self.root, drift_id=drift, apply=True)
        self.assertIs(done["applied"], True)
        self.assertEqual(snapshot(self.root), state2)
        recovered = done["recovered"]
        self.assertTrue(DRIFT_ID.match(recovered or ""), done)
        self.assertNotEqual(recovered, drift)

        undo = srv.ok("tc_restore", root=self.root, drift_id=recovered, apply=True)
        self.assertIs(undo["applied"], True)
        self.assertEqual(snapshot(self.root), state3)


class CompressTest(WorkspaceTest):

    def test_compress_on_fresh_store_returns_zeros_and_echoes_arguments(self):
        srv = self.server(env=WATCH_OFF)
        self.write("a.txt", "a\n")
        srv.ok("tc_init", root=self.root, name="fresh", goal="g")
        res = srv.ok("tc_compress", root=self.root)
        self.assertEqual(set(res) & COMPRESS_FIELDS, COMPRESS_FIELDS, res)
        for key in ("converted", "eligible", "already_gone", "bytes_freed"):
            self.assertEqual(res[key], 0, res)
        self.assertEqual((res["keep_seconds"], res["minimum"], res["maximum"]), (604800, 20, 50))
        res = srv.ok("tc_compress", root=self.root, keep_seconds=0, minimum=3, maximum=7)
        for key in ("converted", "eligible", "already_gone", "bytes_freed"):
            self.assertEqual(res[key], 0, res)
        self.assertEqual((res["keep_seconds"], res["minimum"], res["maximum"]), (0, 3, 7))

    def test_compress_frees_drift_payloads_but_keeps_steps_and_recovered(self):
        srv = self.server(env=WATCH_OFF)
        self.write("a.bin", binary_blob(10, 40000))
        self.write("keep.txt", "stays\n")
        srv.ok("tc_init", root=self.root, name="compress", goal="g")
        srv.ok("tc_save", root=self.root, title="s1", conclusion="c", next="n")
        state1 = snapshot(self.root)

        drifts = []
        for seed in (11, 12, 13):  # three drift-only versions of a.bin
            self.write("a.bin", binary_blob(seed, 40000 + seed))
            drifts.append(srv.ok("tc_capture", root=self.root)["drift_id"])
        self.write("a.bin", binary_blob(14, 50000))
        srv.ok("tc_save", root=self.root, title="s2", conclusion="c", next="n")
        state2 = snapshot(self.root)

        self.write("a.bin", binary_blob(15, 45000))  # an unsaved edit, only in recovered
        self.write("scratch.txt", "unsaved\n")
        unsaved = snapshot(self.root)
        recovered = srv.ok("tc_restore", root=self.root, index=1, apply=True)["recovered"]
        self.assertEqual(snapshot(self.root), state1)

        time.sleep(1.1)  # every drift is now strictly older than keep_seconds=0
        res = srv.ok("tc_compress", root=self.root, keep_seconds=0, minimum=0)
        self.assertEqual(set(res) & COMPRESS_FIELDS, COMPRESS_FIELDS, res)
        self.assertGreater(res["bytes_freed"], 0, res)
        self.assertGreater(res["converted"], 0, res)
        self.assertEqual((res["keep_seconds"], res["minimum"], res["maximum"]), (0, 0, 50))

        for index, expected in ((2, state2), (1, state1)):
            srv.ok("tc_restore", root=self.root, index=index, apply=True)
            self.assertEqual(snapshot(self.root), expected, "step %d after compress" % index)
        srv.ok("tc_restore", root=self.root, drift_id=recovered, apply=True)
        self.assertEqual(snapshot(self.root), unsaved, "recovered record after compress")

        # The first drift held a version nothing else references: it is gone.
        before = snapshot(self.root)
        listing = tree_listing(self.root)
        count = len(all_drifts(srv, self.root))
        for apply in (False, True):
            res = srv.call("tc_restore", root=self.root, drift_id=drifts[0], apply=apply)
            self.assertTrue(res.is_error, res)
            self.assertEqual(len(res.text.strip().splitlines()), 1, res.text)
            self.assertRegex(res.text, r"(?i)%s|compress|reclaim" % drifts[0])
        self.assertEqual(snapshot(self.root), before)
        self.assertEqual([p for p in tree_listing(self.root) if not p[0].startswith(".checkpoints")],
                         [p for p in listing if not p[0].startswith(".checkpoints")])
        self.assertEqual(len(all_drifts(srv, self.root)), count, "refused restore wrote a record")

        again = srv.ok("tc_compress", root=self.root, keep_seconds=0, minimum=0)
        self.assertEqual(again["bytes_freed"], 0, again)
        self.assertEqual(again["converted"], 0, again)

    def payload_files(self):
        base = os.path.join(self.store, "payload")
        return {name: os.path.join(base, prefix, name) for prefix in os.listdir(base)
                if os.path.isdir(os.path.join(base, prefix))
                for name in os.listdir(os.path.join(base, prefix))}

    def test_unnamed_content_goes_by_age_and_named_content_never(self):
        srv = self.server(env=WATCH_OFF)
        self.write("a.bin", binary_blob(30, 20000))
        task_id = srv.ok("tc_init", root=self.root, name="unnamed")["task_id"]
        srv.ok("tc_save", root=self.root, title="s1")
        state1 = snapshot(self.root)
        self.write("a.bin", binary_blob(31, 20000))
        srv.ok("tc_capture", root=self.root)
        self.write("a.bin", binary_blob(32, 20000))
        srv.ok("tc_save", root=self.root, title="s2")
        state2 = snapshot(self.root)
        named = stored_shas(self.store)
        # Content as an interrupted save leaves it: whole, under its own name.
        orphans = {}
        for seed, days in ((33, 8), (34, 1)):
            data = binary_blob(seed, 5000)
            sha = hashlib.sha256(data).hexdigest()
            path = os.path.join(self.store, "payload", sha[:2], sha)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as fh:
                fh.write(data)
            orphans[days] = path
        month_ago = time.time() - 30 * 86400
        for path in list(named.values()) + list(orphans.values()):
            age = 86400 * next((d for d, p in orphans.items() if p == path), 30)
            os.utime(path, (time.time() - age, time.time() - age))
        self.assertEqual(unnamed_payloads(self.store), sorted(
            os.path.basename(p) for p in orphans.values()))
        # A FIFO among the records is not read (it would block): nothing unnamed goes.
        if hasattr(os, "mkfifo"):  # not on Windows
            fifo = os.path.join(self.store, "tasks", task_id, "notes")
            os.mkfifo(fifo)
            res = srv.ok("tc_compress", root=self.root)
            self.assertEqual(res["unreferenced"], 0, res)
            self.assertTrue(all(os.path.exists(p) for p in orphans.values()))
            os.remove(fifo)
        res = srv.ok("tc_compress", root=self.root)  # 7 days: the 8-day-old one goes
        self.assertEqual((res["unreferenced"], res["bytes_freed"]), (1, 5000), res)
        self.assertFalse(os.path.exists(orphans[8]))
        self.assertTrue(os.path.exists(orphans[1]))
        res = srv.ok("tc_compress", root=self.root, keep_seconds=3600)
        self.assertEqual(res["unreferenced"], 1, res)
        self.assertEqual(unnamed_payloads(self.store), [])
        self.assertEqual(set(stored_shas(self.store)), set(named), "named content was removed")
        self.assertLess(os.path.getmtime(next(iter(named.values()))), month_ago + 60)
        for index, expected in ((1, state1), (2, state2)):
            srv.ok("tc_restore", root=self.root, index=index, apply=True)
            self.assertEqual(snapshot(self.root), expected)

    def test_content_a_stopped_compress_left_behind_is_reclaimed_next_time(self):
        srv = self.server(env=WATCH_OFF)
        self.write("a.bin", binary_blob(20, 30000))
        task_id = srv.ok("tc_init", root=self.root, name="stopped compress")["task_id"]
        srv.ok("tc_save", root=self.root, title="s1")
        for seed in (21, 22, 23):  # versions only drift records hold
            self.write("a.bin", binary_blob(seed, 30000 + seed))
            srv.ok("tc_capture", root=self.root)
        self.write("a.bin", binary_blob(24, 31000))
        srv.ok("tc_save", root=self.root, title="s2")
        state2 = snapshot(self.root)
        kept = {name: read_file(path) for name, path in self.payload_files().items()}
        time.sleep(1.1)
        first = srv.ok("tc_compress", root=self.root, keep_seconds=0, minimum=0)
        gone = sorted(set(kept) - set(self.payload_files()))
        self.assertTrue(gone, first)
        # A compress stopped after its records were written and before the
        # content was deleted leaves exactly this: marked records, content there.
        for name in gone:
            with open(os.path.join(self.store, "payload", name[:2], name), "wb") as fh:
                fh.write(kept[name])
        # A damaged record naming a path outside the store is never followed.
        outside = os.path.join(self.tmp, "outside.txt")
        with open(outside, "w") as fh:
            fh.write("not the store's\n")
        drift_dir = os.path.join(self.store, "tasks", task_id, "drifts")
        marked = [name for name in sorted(os.listdir(drift_dir)) if json.loads(
            read_file(os.path.join(drift_dir, name))).get("compressed")]
        self.assertTrue(marked)
        record_path = os.path.join(drift_dir, marked[0])
        record = json.loads(read_file(record_path))
        escape = os.path.relpath(outside, self.store)  # payload/<first 2>/<name>
        self.assertTrue(escape.startswith(".."), escape)
        record["unrestorable"].append(escape)
        with open(record_path, "w") as fh:
            json.dump(record, fh)

        again = srv.ok("tc_compress", root=self.root, keep_seconds=0, minimum=0)
        self.assertEqual(again["bytes_freed"], sum(len(kept[name]) for name in gone), again)
        self.assertEqual(again["converted"], 0, again)
        self.assertEqual(sorted(set(kept) - set(self.payload_files())), gone)
        self.assertTrue(os.path.exists(outside), "compress deleted a file outside the store")
        resume = srv.ok("tc_resume", root=self.root)
        self.assertTrue(resume["health"]["ok"], resume["health"])
        srv.ok("tc_restore", root=self.root, index=1, apply=True)
        srv.ok("tc_restore", root=self.root, index=2, apply=True)
        self.assertEqual(snapshot(self.root), state2)


class QuietPeriodTest(WorkspaceTest):
    """The watcher's tick driven with its own clock."""

    def test_watcher_capture_after_a_quiet_period_is_not_partial(self):
        cp = tc.Checkpoints(tc.Config(watch=True, watch_interval=3600, drift_max_wait=60,
                                      git=False))
        self.write("a.txt", "1\n")
        cp.init(self.root, "t")
        cp.start_watcher()
        try:
            self.write("a.txt", "changed once\n")
            self.assertEqual(cp.watcher.tick(self.root, now=100.0), "wait")
            self.assertEqual(cp.watcher.tick(self.root, now=101.0), "capture")
        finally:
            cp.stop_watcher()
        drift = cp.show(self.root, include_drift=True)["drifts"][-1]
        self.assertEqual(drift["kind"], "watch")
        self.assertFalse(drift["partial"], "a capture after a quiet period is marked partial")


if __name__ == "__main__":
    unittest.main()
