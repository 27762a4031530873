"""tc_restore through a real server: previews, byte-exact round trips, undo,
refusals, sensitive files, permissions, symlinks, a failed apply, what stands
in the way of a recorded file, and folders nested deeper than Python's
recursion limit.

The tests drive `scripts/tc_mcp.py` as a subprocess (two call the core
directly: its tree removal, and a restore whose read of a file fails) and
check real bytes on disk: the workspace after a restore must equal, file by
file and mode by mode, the snapshot taken when the step was saved.
"""

import hashlib
import json
import os
import re
import select
import secrets
import stat
import subprocess
import sys
import time
import unittest

from support import (SCRIPTS, WorkspaceTest, can_symlink, head_index, keeps_mode_bits, path_max,
                     paths_of, snapshot, write)

sys.path.insert(0, SCRIPTS)
import tc  # noqa: E402

DRIFT_ID = re.compile(r"^d\d{4,}$")

# Files whose contents are bookkeeping rather than records: a log line or a
# lock owner written by a read-only call is not a change to the store.
NOT_RECORDS = ("server.log", "state.lock")


def fingerprint(top):
    """Every path under top with its type, size, mode and mtime.

    Bookkeeping files (NOT_RECORDS) count only by presence. Directory
    mtimes are left out so that a lock taken on an existing file is fine.
    """
    out = {}
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames.sort()
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, top)
            st = os.lstat(full)
            if name in NOT_RECORDS:
                out[rel] = "present"
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", st.st_mode)
            elif stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(full))
            else:
                out[rel] = ("file", st.st_size, st.st_mode, st.st_mtime_ns, st.st_ino)
    return out


def directories(root, skip=(".checkpoints", ".git")):
    """Every directory under root (a restore must leave no new or missing ones)."""
    out = set()
    for dirpath, dirnames, _filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip]
        for name in dirnames:
            out.add(os.path.relpath(os.path.join(dirpath, name), root))
    return out


def all_store_bytes(store):
    """(relative path, bytes) of every regular file under the store."""
    for dirpath, _dirnames, filenames in os.walk(store):
        for name in filenames:
            full = os.path.join(dirpath, name)
            if os.path.islink(full) or not os.path.isfile(full):
                continue
            with open(full, "rb") as fh:
                yield os.path.relpath(full, store), fh.read()


class RestoreTest(WorkspaceTest):
    """Shared moves: start a task, save a step, restore, look at the store."""

    def init(self, srv, name="restore task"):
        res = srv.ok("tc_init", root=self.root, name=name, goal="check restores")
        return res["task_id"]

    def save(self, srv, title, **extra):
        res = srv.ok("tc_save", root=self.root, title=title,
                     conclusion="done: " + title, next="continue after " + title, **extra)
        return res["index"]

    def restore(self, srv, **arguments):
        return srv.call("tc_restore", root=self.root, **arguments)

    def restore_ok(self, srv, **arguments):
        return srv.ok("tc_restore", root=self.root, **arguments)

    def task_dir(self, task_id):
        return os.path.join(self.store, "tasks", task_id)

    def record_files(self, task_id):
        """Names of the step, drift and manifest records of a task."""
        out = {}
        for kind in ("steps", "drifts", "manifest"):
            folder = os.path.join(self.task_dir(task_id), kind)
            out[kind] = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
        return out

    def store_records(self, task_id):
        """What a failed restore must leave as it was: records and state files."""
        out = self.record_files(task_id)
        for name in ("state.json", "index.json"):
            path = os.path.join(self.task_dir(task_id), name)
            if os.path.exists(path):
                with open(path, "rb") as fh:
                    out[name] = fh.read()
        current = os.path.join(self.store, "current.json")
        if os.path.exists(current):
            with open(current, "rb") as fh:
                out["current.json"] = fh.read()
        others = set()
        for dirpath, _dirnames, filenames in os.walk(self.store):
            rel_dir = os.path.relpath(dirpath, self.store)
            if rel_dir.split(os.sep)[0] == "payload":
                continue
            for name in filenames:
                if name not in NOT_RECORDS:
                    others.add(os.path.join(rel_dir, name))
        out["files"] = sorted(others)
        return out

    def head(self, srv):
        return head_index(srv.ok("tc_show", root=self.root)["head"])

    def assert_health_ok(self, srv):
        health = srv.ok("tc_resume", root=self.root)["health"]
        self.assertTrue(health["ok"], health)
        self.assertEqual(health["errors"], [])

    def assert_no_traceback(self, res):
        self.assertNotIn("Traceback", res.text)
        self.assertTrue(res.text.strip(), res)


class RoundTrip(RestoreTest):

    def build_three_steps(self, srv):
        blob1 = bytes(range(256)) * 700 + b"\x00\r\n\xff" * 100
        self.write("a.txt", "alpha v1\n")
        self.write("empty.txt", b"")
        self.write("src/main.py", "print('main v1')\n")
        self.write("src/lib/util.py", "def util():\n    return 1\n")
        self.write("bin/run.sh", "#!/bin/sh\necho run v1\n", mode=0o755)
        self.write("data/blob.bin", blob1)
        self.write("docs/readme.md", "# docs\r\nwindows line ends\r\n")
        s1 = self.save(srv, "step one")
        snap1 = snapshot(self.root)

        self.write("a.txt", "alpha v2, longer than before\n")
        os.remove(os.path.join(self.root, "docs", "readme.md"))
        os.rmdir(os.path.join(self.root, "docs"))
        self.write("src/lib/deep/new/mod.py", "VALUE = 2\n")
        self.write("data/blob.bin", blob1[:1000] + b"\x01\x02" + blob1[1002:])
        self.write("\u00fcn\u00ef/\u540d\u524d.txt", "unicode name\n")
        s2 = self.save(srv, "step two")
        snap2 = snapshot(self.root)

        os.remove(os.path.join(self.root, "src", "lib", "util.py"))
        os.remove(os.path.join(self.root, "bin", "run.sh"))
        self.write("a.txt", "alpha v3\n")
        self.write("data/second.bin", os.urandom(300 * 1024))
        self.write("tools/build.sh", "#!/bin/sh\necho build\n", mode=0o750)
        s3 = self.save(srv, "step three")
        snap3 = snapshot(self.root)

        self.assertEqual((s1, s2, s3), (1, 2, 3))
        self.assertEqual(len({repr(sorted(s.items())) for s in (snap1, snap2, snap3)}), 3)
        return snap1, snap2, snap3

    def test_back_forward_and_undo_byte_exact(self):
        srv = self.server()
        self.init(srv)
        snap1, snap2, snap3 = self.build_three_steps(srv)

        # Unsaved work made just before the restore must survive an undo.
        self.write("a.txt", "alpha unsaved edit\n")
        self.write("notes/unsaved.txt", "never saved anywhere\n")
        os.chmod(os.path.join(self.root, "tools", "build.sh"), 0o700)
        before = snapshot(self.root)

        listing = fingerprint(self.tmp)
        preview = self.restore_ok(srv, index=2)
        self.assertEqual(fingerprint(self.tmp), listing, "a preview wrote something")
        self.assertFalse(preview["applied"])
        self.assertIsNone(preview["recovered"])
        plan = preview["plan"]
        for key in ("to_delete", "to_write", "to_replace", "unrestorable"):
            self.assertIn(key, plan)
        self.assertEqual(paths_of(plan["to_delete"]), set(before) - set(snap2))
        self.assertEqual(paths_of(plan["to_write"]), set(snap2) - set(before))
        changed = {p for p in set(before) & set(snap2) if before[p][0] != snap2[p][0]}
        self.assertEqual(paths_of(plan["to_replace"]) - {"tools/build.sh"}, changed)
        self.assertEqual(paths_of(plan["unrestorable"]), set())
        self.assertEqual(snapshot(self.root), before)

        applied = self.restore_ok(srv, index=2, apply=True)
        self.assertTrue(applied["applied"])
        recovered = applied["recovered"]
        self.assertIsInstance(recovered, str)
        self.assertRegex(recovered, DRIFT_ID)
        for key in ("to_delete", "to_write", "to_replace", "unrestorable"):
            self.assertEqual(paths_of(applied["plan"][key]), paths_of(plan[key]), key)
        self.assertEqual(snapshot(self.root), snap2)
        self.assertEqual(self.head(srv), 2)
        self.assertFalse(os.path.exists(os.path.join(self.root, "notes", "unsaved.txt")))
        resume = srv.ok("tc_resume", root=self.root)
        self.assertEqual(resume["drift_paths"], [])
        shown = srv.ok("tc_show", root=self.root, include_drift=True, limit=200)
        self.assertIn(recovered, [d["id"] for d in shown["drifts"]])

        # Nothing left to do: the same preview is now empty.
        again = self.restore_ok(srv, index=2)
        for key in ("to_delete", "to_write", "to_replace"):
            self.assertEqual(paths_of(again["plan"][key]), set(), key)

        forward = self.restore_ok(srv, index=3, apply=True)
        self.assertTrue(forward["applied"])
        self.assertEqual(snapshot(self.root), snap3)
        self.assertEqual(self.head(srv), 3)

        back = self.restore_ok(srv, index=1, apply=True)
        self.assertEqual(snapshot(self.root), snap1)

        undo = self.restore_ok(srv, drift_id=recovered, apply=True)
        self.assertTrue(undo["applied"])
        self.assertEqual(snapshot(self.root), before)
        self.assertEqual(self.read("a.txt"), b"alpha unsaved edit\n")
        self.assertEqual(self.read("notes/unsaved.txt"), b"never saved anywhere\n")
        self.assertNotEqual(undo["recovered"], recovered)

        # And the undo of the undo brings step 1 back.
        self.restore_ok(srv, drift_id=undo["recovered"], apply=True)
        self.assertEqual(snapshot(self.root), snap1)
        self.assert_health_ok(srv)

    def test_a_new_server_restores_what_another_saved(self):
        srv = self.server()
        self.init(srv)
        snap1, snap2, _snap3 = self.build_three_steps(srv)
        srv.close()
        other = self.server()
        self.restore_ok(other, index=1, apply=True)
        self.assertEqual(snapshot(self.root), snap1)
        self.restore_ok(other, index=2, apply=True)
        self.assertEqual(snapshot(self.root), snap2)

    def test_step_numbers_are_never_reused(self):
        srv = self.server()
        self.init(srv)
        for i in range(1, 4):
            self.write("f.txt", "version %d\n" % i)
            self.assertEqual(self.save(srv, "step %d" % i), i)
        self.restore_ok(srv, index=1, apply=True)
        self.assertEqual(self.read("f.txt"), b"version 1\n")
        self.assertEqual(self.head(srv), 1)
        self.write("f.txt", "a new branch of work\n")
        self.assertEqual(self.save(srv, "after going back"), 4)
        shown = srv.ok("tc_show", root=self.root, limit=200)
        indices = [step["index"] for step in shown["steps"]]
        self.assertEqual(sorted(indices), [1, 2, 3, 4])
        titles = {step["index"]: step["title"] for step in shown["steps"]}
        self.assertEqual(titles[3], "step 3")
        self.assertEqual(titles[4], "after going back")
        self.assertEqual(self.head(srv), 4)
        # Step 3 is still there and still restores.
        self.restore_ok(srv, index=3, apply=True)
        self.assertEqual(self.read("f.txt"), b"version 3\n")


class Shapes(RestoreTest):
    """Paths that change kind, excluded names, baselines and other stores."""

    def test_file_and_directory_swap_places(self):
        srv = self.server()
        self.init(srv)
        self.write("x/y.txt", "x is a folder at step 1\n")
        self.write("x/deeper/z.txt", "deeper\n")
        self.write("f", "f is a file at step 1\n")
        self.save(srv, "one")
        snap1 = snapshot(self.root)
        for rel in ("x/deeper/z.txt", "x/y.txt", "f"):
            os.remove(os.path.join(self.root, rel))
        os.rmdir(os.path.join(self.root, "x", "deeper"))
        os.rmdir(os.path.join(self.root, "x"))
        self.write("x", "x is a file at step 2\n")
        self.write("f/inside.txt", "f is a folder at step 2\n")
        self.save(srv, "two")
        snap2 = snapshot(self.root)
        for index, expected in ((1, snap1), (2, snap2), (1, snap1)):
            self.restore_ok(srv, index=index, apply=True)
            self.assertEqual(snapshot(self.root), expected, index)
            resume = srv.ok("tc_resume", root=self.root)
            self.assertEqual(resume["drift_paths"], [], index)
            self.assertTrue(resume["health"]["ok"], resume["health"])

    def test_a_file_with_a_long_name(self):
        # 250 bytes: a legal name on every common file system (the limit is
        # 255), so a restore must be able to write it back.
        long_name = "L" * 246 + ".txt"
        srv = self.server()
        self.init(srv)
        try:
            self.write("dir/" + long_name, "long v1\n")
        except OSError as exc:  # Windows without long paths: 260 characters in all
            self.skipTest("cannot make a file whose path is %d characters long: %s"
                          % (len(os.path.join(self.root, "dir", long_name)), exc))
        self.write("a.txt", "a v1\n")
        self.save(srv, "one")
        snap1 = snapshot(self.root)
        self.write("dir/" + long_name, "long v2, changed\n")
        self.write("a.txt", "a v2\n")
        self.save(srv, "two")
        snap2 = snapshot(self.root)
        self.write("fresh.txt", "unsaved\n")
        res = self.restore(srv, index=1, apply=True)
        self.assertFalse(res.is_error, res)
        self.assertEqual(snapshot(self.root), snap1)
        os.remove(os.path.join(self.root, "dir", long_name))
        res = self.restore(srv, index=2, apply=True)
        self.assertFalse(res.is_error, res)
        self.assertEqual(snapshot(self.root), snap2)
        self.assert_health_ok(srv)

    def test_excluded_names_are_never_touched(self):
        srv = self.server()
        self.init(srv)
        self.write("a.txt", "a v1\n")
        self.save(srv, "one")
        self.write("a.txt", "a v2\n")
        self.save(srv, "two")
        kept = {
            "node_modules/pkg/index.js": b"module\n",
            "build/out.o": b"\x7fELF",
            "src/__pycache__/m.cpython-311.pyc": b"pyc",
            "notes.bak": b"backup copy\n",
            ".venv/bin/python": b"venv\n",
            ".git/HEAD": b"ref: refs/heads/main\n",
        }
        for rel, data in kept.items():
            self.write(rel, data)
        preview = self.restore_ok(srv, index=1)
        planned = set()
        for key in ("to_delete", "to_write", "to_replace", "unrestorable"):
            planned |= paths_of(preview["plan"][key])
        self.assertEqual(planned, {"a.txt"})
        self.restore_ok(srv, index=1, apply=True)
        self.assertEqual(self.read("a.txt"), b"a v1\n")
        for rel, data in kept.items():
            self.assertEqual(self.read(rel), data, rel)

    def test_restore_to_the_baseline_drift_of_tc_init(self):
        self.write("a.txt", "before the task\n")
        self.write("lib/b.bin", os.urandom(5000))
        at_init = snapshot(self.root)
        srv = self.server()
        self.init(srv)
        drifts = srv.ok("tc_show", root=self.root, include_drift=True)["drifts"]
        self.assertTrue(drifts, "tc_init recorded no baseline")
        baseline = drifts[0]["id"]
        self.write("a.txt", "during the task\n")
        self.write("c.txt", "new\n")
        os.remove(os.path.join(self.root, "lib", "b.bin"))
        self.save(srv, "one")
        applied = self.restore_ok(srv, drift_id=baseline, apply=True)
        self.assertTrue(applied["applied"])
        self.assertEqual(snapshot(self.root), at_init)
        shown = srv.ok("tc_show", root=self.root, include_drift=True, limit=200)
        self.assertIn(applied["recovered"], [d["id"] for d in shown["drifts"]])

    def test_a_store_inside_the_workspace_survives_restores(self):
        srv = self.server()
        inner = os.path.join(self.root, "cp-store")
        res = srv.ok("tc_init", root=self.root, name="inner store", store=inner)
        self.assertEqual(os.path.realpath(res["store"]), inner)
        self.write("a.txt", "a v1\n")
        self.save(srv, "one")
        snap1 = snapshot(self.root, skip=(".checkpoints", ".git", "cp-store"))
        self.write("a.txt", "a v2\n")
        self.write("b.txt", "b\n")
        self.save(srv, "two")
        store_files = sorted(os.listdir(inner))
        preview = self.restore_ok(srv, index=1)
        for key in ("to_delete", "to_write", "to_replace", "unrestorable"):
            for path in paths_of(preview["plan"][key]):
                self.assertFalse(path.startswith(("cp-store", ".task-checkpoint-store")), path)
        self.restore_ok(srv, index=1, apply=True)
        self.assertEqual(snapshot(self.root, skip=(".checkpoints", ".git", "cp-store")), snap1)
        self.assertTrue(set(store_files) <= set(os.listdir(inner)))
        self.restore_ok(srv, index=2, apply=True)
        self.assertEqual(self.read("b.txt"), b"b\n")
        self.assert_health_ok(srv)

    def test_an_external_store_and_its_pointer(self):
        outside = os.path.join(self.tmp, "elsewhere")
        os.makedirs(outside)
        srv = self.server(env={"TC_STORE": outside})
        res = srv.ok("tc_init", root=self.root, name="external store")
        self.assertTrue(res["store_is_external"])
        self.write("a.txt", "a v1\n")
        self.save(srv, "one")
        self.write("a.txt", "a v2\n")
        self.save(srv, "two")
        pointer = os.path.join(self.root, ".task-checkpoint-store.json")
        self.assertTrue(os.path.isfile(pointer))
        with open(pointer, "rb") as fh:
            pointer_bytes = fh.read()
        self.restore_ok(srv, index=1, apply=True)
        self.assertEqual(self.read("a.txt"), b"a v1\n")
        with open(pointer, "rb") as fh:
            self.assertEqual(fh.read(), pointer_bytes)
        self.assertFalse(os.path.exists(self.store))
        self.assertTrue(os.path.isdir(os.path.join(outside, "tasks")))


class HardLinks(RestoreTest):

    def test_a_file_hard_linked_from_outside_is_replaced_not_written_through(self):
        outside = os.path.join(self.tmp, "outside.txt")
        with open(outside, "wb") as fh:
            fh.write(b"shared v1\n")
        os.link(outside, os.path.join(self.root, "linked.txt"))
        srv = self.server()
        self.init(srv)
        self.save(srv, "one")
        with open(os.path.join(self.root, "linked.txt"), "wb") as fh:
            fh.write(b"shared v2\n")  # writes through the link, as editors may
        self.save(srv, "two")
        self.restore_ok(srv, index=1, apply=True)
        self.assertEqual(self.read("linked.txt"), b"shared v1\n")
        with open(outside, "rb") as fh:
            self.assertEqual(fh.read(), b"shared v2\n", "a restore changed a file outside the workspace")


class LostContent(RestoreTest):

    def payload_path(self, data):
        sha = hashlib.sha256(data).hexdigest()
        return os.path.join(self.store, "payload", sha[:2], sha)

    def test_current_content_missing_from_the_store_is_read_again_before_overwriting(self):
        srv = self.server()
        self.init(srv)
        self.write("f.txt", b"one\n")
        self.write("keep.txt", b"kept\n")
        self.save(srv, "one")
        current = b"two, saved and then lost from the store\n"
        self.write("f.txt", current)
        self.save(srv, "two")
        time.sleep(0.05)
        srv.ok("tc_capture", root=self.root)  # the index now vouches for f.txt without reading
        lost = self.payload_path(current)
        self.assertTrue(os.path.isfile(lost))
        os.remove(lost)  # the stat cache still vouches for f.txt's sha

        applied = self.restore_ok(srv, index=1, apply=True)
        self.assertEqual(self.read("f.txt"), b"one\n")
        self.assertTrue(os.path.isfile(lost), "the overwritten content was not stored again")
        self.restore_ok(srv, drift_id=applied["recovered"], apply=True)
        self.assertEqual(self.read("f.txt"), current)
        self.assertEqual(self.read("keep.txt"), b"kept\n")

    def damage(self, data, garbage):
        with open(self.payload_path(data), "wb") as fh:
            fh.write(garbage)

    def test_current_content_whose_stored_copy_is_damaged_is_stored_again(self):
        srv = self.server()
        self.init(srv)
        self.write("f.txt", b"one\n")
        self.save(srv, "one")
        current = b"two, saved, then its stored copy damaged\n"
        self.write("f.txt", current)
        self.save(srv, "two")
        self.damage(current, b"truncated")

        applied = self.restore_ok(srv, index=1, apply=True)
        self.assertEqual(self.read("f.txt"), b"one\n")
        with open(self.payload_path(current), "rb") as fh:
            self.assertEqual(fh.read(), current)
        self.restore_ok(srv, drift_id=applied["recovered"], apply=True)
        self.assertEqual(self.read("f.txt"), current)

    def test_a_rollback_that_meets_damaged_content_finishes_and_says_so(self):
        srv = self.server()
        self.init(srv)
        self.write("a.txt", b"a one\n")
        self.write("f.txt", b"f one\n")
        self.save(srv, "one")
        self.write("a.txt", b"a two\n")
        self.write("f.txt", b"f two\n")
        self.save(srv, "two")
        # Same sizes, wrong bytes: nothing short of reading them shows it.
        self.damage(b"f one\n", b"xxxxxx")
        self.damage(b"f two\n", b"yyyyyy")

        res = self.restore(srv, index=1, apply=True)
        self.assertTrue(res.is_error)
        self.assert_no_traceback(res)
        self.assertIn("could not be put back", res.text)
        self.assertIn("'f.txt'", res.text)
        self.assertEqual(self.read("a.txt"), b"a two\n")  # put back from its good copy
        # The store is not left waiting on a rollback that can never finish.
        self.write("g.txt", b"new work\n")
        self.assertEqual(self.save(srv, "three"), 3)
        self.assertEqual(srv.ok("tc_compress", root=self.root, keep_seconds=0)["keep_seconds"], 0)


class Refusals(RestoreTest):

    def setUp(self):
        super().setUp()
        self.srv = self.server()
        self.task_id = self.init(self.srv)
        self.write("f.txt", "one\n")
        self.save(self.srv, "one")
        self.write("f.txt", "two\n")
        self.save(self.srv, "two")
        self.write("f.txt", "unsaved\n")

    def assert_refused(self, words, **arguments):
        listing = fingerprint(self.tmp)
        records = self.store_records(self.task_id)
        res = self.restore(self.srv, **arguments)
        self.assertTrue(res.is_error, res)
        self.assert_no_traceback(res)
        low = res.text.lower()
        self.assertTrue(any(word in low for word in words), res.text)
        self.assertEqual(fingerprint(self.tmp), listing)
        self.assertEqual(self.store_records(self.task_id), records)
        self.assertEqual(self.read("f.txt"), b"unsaved\n")
        return res

    def test_both_index_and_drift_id(self):
        first = self.restore_ok(self.srv, index=1, apply=True)
        self.write("f.txt", "unsaved\n")
        self.assert_refused(("index", "drift"), index=1, drift_id=first["recovered"], apply=True)
        self.assert_refused(("index", "drift"), index=1, drift_id=first["recovered"])

    def test_neither_index_nor_drift_id(self):
        self.assert_refused(("index", "drift"), apply=True)
        self.assert_refused(("index", "drift"))

    def test_index_out_of_range(self):
        res = self.assert_refused(("99", "step", "index"), index=99, apply=True)
        self.assertIn("99", res.text)
        self.assert_refused(("99", "step", "index"), index=99)

    def test_a_task_without_steps_says_so(self):
        srv = self.server()
        other = os.path.join(self.tmp, "fresh")
        write(other, "a.txt", "a\n")
        srv.ok("tc_init", root=other, name="no steps yet")
        res = srv.call("tc_restore", root=other, index=1)
        self.assertTrue(res.is_error, res)
        self.assertIn("no steps yet", res.text)
        self.assertNotIn("1..0", res.text)

    def test_unknown_and_malformed_drift_ids(self):
        self.assert_refused(("d9999", "drift"), drift_id="d9999", apply=True)
        for bad in ("../../etc", "d0001/../x", "", "d1 x", "d0001\n"):
            self.assert_refused(("drift",), drift_id=bad, apply=True)
        self.assert_refused(("not a drift id",), drift_id="d0001\n")

    def test_closed_task_previews_but_does_not_apply(self):
        self.write("f.txt", "three\n")
        closed = self.srv.ok("tc_save", root=self.root, title="three", conclusion="all done",
                             next="nothing", close=True)
        self.assertTrue(closed["closed"])
        self.write("f.txt", "edited after closing\n")
        listing = fingerprint(self.tmp)
        preview = self.restore_ok(self.srv, index=1)
        self.assertFalse(preview["applied"])
        self.assertIn("f.txt", paths_of(preview["plan"]["to_replace"]))
        self.assertEqual(fingerprint(self.tmp), listing)

        records = self.store_records(self.task_id)
        res = self.restore(self.srv, index=1, apply=True)
        self.assertTrue(res.is_error, res)
        self.assert_no_traceback(res)
        self.assertIn("closed", res.text.lower())
        self.assertEqual(self.read("f.txt"), b"edited after closing\n")
        self.assertEqual(fingerprint(self.tmp), listing)
        self.assertEqual(self.store_records(self.task_id), records)


class BadArguments(RestoreTest):
    """Refused before anything is read or written, with the argument named."""

    def test_no_task_yet(self):
        self.write("a.txt", "untracked\n")
        srv = self.server()
        listing = fingerprint(self.tmp)
        for arguments in ({"index": 1}, {"index": 1, "apply": True}, {"drift_id": "d0001"}):
            res = self.restore(srv, **arguments)
            self.assertTrue(res.is_error, res)
            self.assert_no_traceback(res)
        self.assertEqual(fingerprint(self.tmp), listing)
        self.assertFalse(os.path.exists(self.store))

    def test_wrong_types_and_roots(self):
        srv = self.server()
        self.init(srv)
        self.write("a.txt", "v1\n")
        self.save(srv, "one")
        self.write("a.txt", "unsaved\n")
        listing = fingerprint(self.tmp)
        cases = [
            ("index", {"root": self.root, "index": "1", "apply": True}),
            ("apply", {"root": self.root, "index": 1, "apply": "yes"}),
            ("drift_id", {"root": self.root, "drift_id": 1, "apply": True}),
            ("index", {"root": self.root, "index": 0, "apply": True}),
            ("index", {"root": self.root, "index": -1, "apply": True}),
            ("root", {"root": "ws", "index": 1, "apply": True}),
            ("root", {"root": os.path.join(self.tmp, "missing"), "index": 1, "apply": True}),
            ("root", {"root": os.path.join(self.root, "a.txt"), "index": 1, "apply": True}),
            ("root", {"index": 1, "apply": True}),
            ("bogus", {"root": self.root, "index": 1, "apply": True, "bogus": 1}),
        ]
        for name, arguments in cases:
            res = srv.call("tc_restore", **arguments)
            self.assertTrue(res.is_error, (arguments, res))
            self.assert_no_traceback(res)
            self.assertIn(name, res.text, arguments)
        self.assertEqual(fingerprint(self.tmp), listing)
        self.assertEqual(self.read("a.txt"), b"unsaved\n")

    def test_a_root_with_spaces_and_non_ascii_letters(self):
        self.root = os.path.join(self.tmp, "my work \u00e9t\u00e9 \u6587")
        os.makedirs(self.root)
        srv = self.server()
        self.init(srv)
        self.write("a b/c d.txt", "spaces v1\n")
        self.save(srv, "one")
        snap1 = snapshot(self.root)
        self.write("a b/c d.txt", "spaces v2\n")
        self.write("e f.txt", "more\n")
        self.save(srv, "two")
        self.restore_ok(srv, index=1, apply=True)
        self.assertEqual(snapshot(self.root), snap1)


class SensitiveFiles(RestoreTest):

    def test_sensitive_files_are_never_touched_and_never_stored(self):
        srv = self.server()
        task_id = self.init(srv)
        markers = [secrets.token_hex(16) for _ in range(5)]
        env1 = ("API_TOKEN=%s\n" % markers[0]).encode()
        env2 = ("API_TOKEN=%s\nEXTRA=%s\n" % (markers[1], markers[1])).encode()
        key = ("-----BEGIN KEY-----\n%s\n-----END KEY-----\n" % markers[2]).encode()
        config_secret = ('{"password": "%s"}\n' % markers[3]).encode()
        aws = ("[default]\naws_secret_access_key = %s\n" % markers[4]).encode()

        self.write(".env", env1)
        self.write("config/secrets.json", config_secret)
        self.write("a.txt", "a v1\n")
        self.write("src/code.py", "x = 1\n")
        first = srv.ok("tc_save", root=self.root, title="one", conclusion="c", next="n")
        self.assertEqual(first["index"], 1)
        snap1 = snapshot(self.root)

        self.write(".env", env2)
        self.write("keys/id_rsa", key, mode=0o600)
        self.write(".aws/credentials", aws)
        os.remove(os.path.join(self.root, "config", "secrets.json"))
        self.write("a.txt", "a v2\n")
        self.write("b.txt", "b new\n")
        self.save(srv, "two")

        sensitive = {".env", "keys/id_rsa", "config/secrets.json"}
        preview = self.restore_ok(srv, index=1)
        plan = preview["plan"]
        self.assertTrue(sensitive <= paths_of(plan["unrestorable"]), plan)
        touched = (paths_of(plan["to_delete"]) | paths_of(plan["to_write"])
                   | paths_of(plan["to_replace"]))
        self.assertFalse(touched & sensitive, plan)
        self.assertFalse({p for p in touched if p.startswith(".aws")}, plan)
        self.assertIn("a.txt", paths_of(plan["to_replace"]))
        self.assertIn("b.txt", paths_of(plan["to_delete"]))

        applied = self.restore_ok(srv, index=1, apply=True)
        self.assertTrue(applied["applied"])
        self.assertEqual(paths_of(applied["plan"]["unrestorable"]) & sensitive, sensitive)
        self.assertEqual(self.read(".env"), env2)
        self.assertEqual(self.read("keys/id_rsa"), key)
        if keeps_mode_bits():  # on Windows there is no 0600 to keep
            self.assertEqual(os.stat(os.path.join(self.root, "keys", "id_rsa")).st_mode & 0o777,
                             0o600)
        self.assertEqual(self.read(".aws/credentials"), aws)
        self.assertFalse(os.path.exists(os.path.join(self.root, "config", "secrets.json")))
        # Everything else is back as it was at step 1.
        now = snapshot(self.root)
        for path, value in snap1.items():
            if path not in sensitive:
                self.assertEqual(now.get(path), value, path)
        self.assertNotIn("b.txt", now)

        # Undo: the sensitive files still stay exactly as they are.
        self.restore_ok(srv, drift_id=applied["recovered"], apply=True)
        self.assertEqual(self.read("b.txt"), b"b new\n")
        self.assertEqual(self.read(".env"), env2)
        self.assertEqual(self.read("keys/id_rsa"), key)
        srv.ok("tc_resume", root=self.root)
        srv.ok("tc_show", root=self.root, include_drift=True)

        for rel, data in all_store_bytes(self.store):
            for marker in markers:
                self.assertNotIn(marker.encode(), data, "secret content stored in " + rel)
                self.assertNotIn(marker, rel)
            for secret in (env1, env2, key, config_secret, aws):
                self.assertNotIn(hashlib.sha256(secret).hexdigest().encode(), data,
                                 "a sensitive file's hash stored in " + rel)
        self.assertTrue(os.path.isdir(self.task_dir(task_id)))


class ModesAndTimes(RestoreTest):

    def test_exec_bits_read_only_files_and_mtimes(self):
        srv = self.server()
        self.init(srv)
        old = 1_000_000_000
        self.write("run.sh", "#!/bin/sh\necho one\n", mode=0o755)
        self.write("ro.txt", "read only v1\n", mode=0o444)
        self.write("keep.txt", "never changes\n")
        self.write("edited.txt", "edited v1\n")
        for rel in ("keep.txt", "edited.txt"):
            os.utime(os.path.join(self.root, rel), (old, old))
        self.save(srv, "one")
        snap1 = snapshot(self.root)

        run = os.path.join(self.root, "run.sh")
        ro = os.path.join(self.root, "ro.txt")
        self.write("run.sh", "#!/bin/sh\necho two, changed\n")
        os.chmod(run, 0o644)
        os.chmod(ro, 0o644)
        self.write("ro.txt", "read only v2, longer\n")
        os.chmod(ro, 0o444)
        self.write("edited.txt", "edited v2\n")
        self.write("gone.sh", "#!/bin/sh\n", mode=0o700)
        self.save(srv, "two")
        keep_before = os.stat(os.path.join(self.root, "keep.txt"))

        preview = self.restore_ok(srv, index=1)
        self.assertEqual(paths_of(preview["plan"]["to_replace"]),
                         {"run.sh", "ro.txt", "edited.txt"})
        self.assertEqual(paths_of(preview["plan"]["to_delete"]), {"gone.sh"})

        started = time.time()
        self.restore_ok(srv, index=1, apply=True)
        self.assertEqual(snapshot(self.root), snap1)
        exec_bits = keeps_mode_bits()  # Windows keeps only the read-only flag
        if exec_bits:
            self.assertEqual(os.stat(run).st_mode & 0o777, 0o755)
        self.assertEqual(os.stat(ro).st_mode & 0o777, 0o444)
        keep_after = os.stat(os.path.join(self.root, "keep.txt"))
        self.assertEqual(keep_after.st_mtime_ns, keep_before.st_mtime_ns)
        self.assertEqual(keep_after.st_ino, keep_before.st_ino)
        # Rewritten files get a fresh mtime, never the recorded old one.
        edited = os.stat(os.path.join(self.root, "edited.txt"))
        self.assertGreater(edited.st_mtime, started - 60)

        # A deleted executable comes back executable.
        os.remove(run)
        self.restore_ok(srv, index=1, apply=True)
        if exec_bits:
            self.assertEqual(os.stat(run).st_mode & 0o777, 0o755)
        self.assertEqual(self.read("run.sh"), b"#!/bin/sh\necho one\n")


class FailedApply(RestoreTest):

    def test_apply_that_fails_midway_leaves_everything_as_it_was(self):
        srv = self.server()
        task_id = self.init(srv)
        self.write("a.txt", "a v1\n")
        self.write("aa/deep/x.txt", "written before the obstacle is met\n")
        self.write("d", "d was a plain file at step 1\n")
        for i in range(20):
            self.write("many/%02d.txt" % i, "many v1 %d\n" % i)
        self.save(srv, "one")
        snap1 = snapshot(self.root)

        os.remove(os.path.join(self.root, "d"))
        os.remove(os.path.join(self.root, "aa", "deep", "x.txt"))
        os.rmdir(os.path.join(self.root, "aa", "deep"))
        os.rmdir(os.path.join(self.root, "aa"))
        self.write("a.txt", "a v2\n")
        for i in range(20):
            self.write("many/%02d.txt" % i, "many v2 %d\n" % i)
        self.save(srv, "two")

        # Unsaved edits, and `d` is now a directory that cannot be removed by
        # the restore: it holds an excluded folder the scan never lists.
        self.write("a.txt", "a v3 unsaved\n")
        self.write("fresh.txt", "fresh unsaved\n")
        self.write("d/inner.txt", "unsaved inside d\n")
        self.write("d/node_modules/keep.js", "module.exports = 1;\n")
        self.write("many/05.txt", "many unsaved\n", mode=0o600)
        self.write("zz/unsaved/u.txt", "deleted, then its folders pruned\n")
        os.makedirs(os.path.join(self.root, "empty", "folder"))
        before = snapshot(self.root)
        dirs_before = directories(self.root)
        head_before = self.head(srv)
        records = self.store_records(task_id)

        res = self.restore(srv, index=1, apply=True)
        if res.is_error:
            self.assert_no_traceback(res)
            self.assertNotIn("\n", res.text.strip())
            self.assertEqual(snapshot(self.root), before)
            self.assertEqual(directories(self.root), dirs_before)
            self.assertEqual(self.store_records(task_id), records)
            self.assertEqual(self.head(srv), head_before)
        else:
            # The only other acceptable outcome: `d` is left as it is (seen up
            # front as unrestorable, or when the restore got to it), named with
            # the reason, and everything else restored.
            reasons = {item["path"]: item["reason"]
                       for item in res["plan"]["unrestorable"] + res["skipped_paths"]}
            self.assertIn("d", reasons, res.data)
            self.assertIn("folder", reasons["d"])
            self.assertEqual(self.read("d/node_modules/keep.js"), b"module.exports = 1;\n")
            self.assertEqual(self.read("a.txt"), b"a v1\n")
            self.assertEqual(self.read("aa/deep/x.txt"), b"written before the obstacle is met\n")
        self.assert_health_ok(srv)

        # With the obstacle gone the same restore works.
        for rel in ("d/node_modules/keep.js", "d/inner.txt"):
            if os.path.exists(os.path.join(self.root, rel)):
                os.remove(os.path.join(self.root, rel))
        os.rmdir(os.path.join(self.root, "d", "node_modules"))
        if os.path.isdir(os.path.join(self.root, "d")):
            os.rmdir(os.path.join(self.root, "d"))
        self.restore_ok(srv, index=1, apply=True)
        self.assertEqual(snapshot(self.root), snap1)
        self.assert_health_ok(srv)


@unittest.skipUnless(can_symlink(), "needs the right to make symlinks")
class Symlinks(RestoreTest):

    def setUp(self):
        super().setUp()
        self.outside = os.path.join(self.tmp, "outside")
        self.marker = secrets.token_hex(16)
        write(self.outside, "target.txt", "outside " + self.marker + "\n")
        write(self.outside, "victim.txt", "victim must stay\n")
        write(self.outside, "sub/f.txt", "outside sub stays\n")
        self.outside_before = snapshot(self.outside)

    def test_symlinks_are_skipped_and_never_followed(self):
        srv = self.server()
        self.init(srv)
        self.write("real.txt", "real\n")
        os.symlink(os.path.join(self.outside, "target.txt"), os.path.join(self.root, "link.txt"))
        os.symlink(self.outside, os.path.join(self.root, "linkdir"), target_is_directory=True)
        saved = srv.ok("tc_save", root=self.root, title="one", conclusion="c", next="n")
        skipped = paths_of(saved["skipped_paths"])
        self.assertIn("link.txt", skipped)
        self.assertIn("linkdir", skipped)

        self.write("real.txt", "changed\n")
        preview = self.restore_ok(srv, index=1)
        self.assertIn("link.txt", paths_of(preview["skipped_paths"]))
        touched = (paths_of(preview["plan"]["to_delete"]) | paths_of(preview["plan"]["to_write"])
                   | paths_of(preview["plan"]["to_replace"]))
        self.assertFalse({p for p in touched if p.startswith(("link", "linkdir/"))}, touched)

        applied = self.restore_ok(srv, index=1, apply=True)
        self.assertIn("link.txt", paths_of(applied["skipped_paths"]))
        self.assertEqual(self.read("real.txt"), b"real\n")
        self.assertTrue(os.path.islink(os.path.join(self.root, "link.txt")))
        self.assertTrue(os.path.islink(os.path.join(self.root, "linkdir")))
        self.assertEqual(snapshot(self.outside), self.outside_before)
        for rel, data in all_store_bytes(self.store):
            self.assertNotIn(self.marker.encode(), data, "followed a symlink into " + rel)

    def test_restore_never_writes_through_a_symlink(self):
        srv = self.server()
        self.init(srv)
        self.write("real.txt", "real at step 1\n")
        self.write("sub/f.txt", "sub file at step 1\n")
        self.write("plain.txt", "plain v1\n")
        self.save(srv, "one")

        os.remove(os.path.join(self.root, "real.txt"))
        os.symlink(os.path.join(self.outside, "victim.txt"), os.path.join(self.root, "real.txt"))
        os.remove(os.path.join(self.root, "sub", "f.txt"))
        os.rmdir(os.path.join(self.root, "sub"))
        os.symlink(os.path.join(self.outside, "sub"), os.path.join(self.root, "sub"),
                   target_is_directory=True)
        self.write("plain.txt", "plain v2\n")

        res = self.restore(srv, index=1, apply=True)
        self.assert_no_traceback(res)
        self.assertEqual(snapshot(self.outside), self.outside_before)
        if not res.is_error:
            self.assertEqual(self.read("plain.txt"), b"plain v1\n")
            # Each path is either left alone (still a link) or was replaced
            # by a real file or folder holding the step's own content.
            real = os.path.join(self.root, "real.txt")
            if not os.path.islink(real):
                self.assertEqual(self.read("real.txt"), b"real at step 1\n")
            sub = os.path.join(self.root, "sub")
            if not os.path.islink(sub):
                self.assertEqual(self.read("sub/f.txt"), b"sub file at step 1\n")
        else:
            self.assertEqual(self.read("plain.txt"), b"plain v2\n")
        self.assert_health_ok(srv)


DEEP_FOLDERS = 1100
# The deepest path these tests name whole: a/ DEEP_FOLDERS times, under a temporary folder.
DEEP_PATH = 2 * DEEP_FOLDERS + 300


@unittest.skipUnless(os.open in os.supports_dir_fd and os.mkdir in os.supports_dir_fd,
                     "needs dir_fd to make folders deeper than a path can name (not on Windows)")
@unittest.skipUnless((path_max() or 0) > DEEP_PATH,
                     "needs paths of %d characters; PATH_MAX is %s here" % (DEEP_PATH, path_max()))
class DeepFolderTests(WorkspaceTest):
    """Folders nested deeper than Python's recursion limit (about 1,000)."""

    DEPTH = DEEP_FOLDERS

    def tearDown(self):
        for srv in self._servers:
            srv.close()
        # os.walk and shutil.rmtree recurse once per level before Python 3.12.
        for name in ("ws", "fresh", "out"):
            subprocess.run(["rm", "-rf", os.path.join(self.tmp, name)], check=True)
        super().tearDown()

    def make_deep(self, base):
        """base/a/a/.../a/f.txt, DEPTH folders down; the relative path."""
        fd = os.open(base, os.O_RDONLY)
        try:
            for _ in range(self.DEPTH):
                os.mkdir("a", dir_fd=fd)
                inner = os.open("a", os.O_RDONLY, dir_fd=fd)
                os.close(fd)
                fd = inner
            out = os.open("f.txt", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
            os.write(out, b"deep\n")
            os.close(out)
        finally:
            os.close(fd)
        return "/".join(["a"] * self.DEPTH + ["f.txt"])

    def test_restore_export_and_import_recreate_deep_folders(self):
        rel = self.make_deep(self.root)
        self.write("top.txt", "top\n")
        srv = self.server(env={"TC_WATCH": "off"})
        srv.ok("tc_init", root=self.root, name="deep")
        srv.ok("tc_save", root=self.root, title="deep tree")
        subprocess.run(["rm", "-rf", os.path.join(self.root, "a")], check=True)
        srv.ok("tc_save", root=self.root, title="tree removed")
        res = srv.ok("tc_restore", root=self.root, index=1, apply=True)
        self.assertEqual(res["plan"]["to_write"], [rel])
        self.assertEqual(self.read(rel), b"deep\n")
        out = os.path.join(self.tmp, "out")
        os.mkdir(out)
        package = srv.ok("tc_export", root=self.root, to=out)["path"]
        fresh = os.path.join(self.tmp, "fresh")
        os.mkdir(fresh)
        srv.ok("tc_import", root=fresh, package=package)
        with open(os.path.join(fresh, *rel.split("/"))) as fh:
            self.assertEqual(fh.read(), "deep\n")
        undo = srv.ok("tc_restore", root=self.root, index=2, apply=True)
        self.assertEqual(undo["plan"]["to_delete"], [rel])
        self.assertEqual(sorted(os.listdir(self.root)), [".checkpoints", "top.txt"])

    def test_removing_a_deep_tree_never_follows_a_link(self):
        outside = os.path.join(self.tmp, "outside")
        os.mkdir(outside)
        with open(os.path.join(outside, "keep.txt"), "w") as fh:
            fh.write("not to be removed\n")
        doomed = os.path.join(self.tmp, "out")
        os.mkdir(doomed)
        rel = self.make_deep(doomed)
        middle = os.path.join(doomed, *["a"] * 500)
        os.symlink(outside, os.path.join(middle, "link"), target_is_directory=True)
        os.symlink(os.path.join(outside, "keep.txt"), os.path.join(middle, "file-link"))
        tc.remove_tree(doomed)
        self.assertFalse(os.path.lexists(doomed))
        self.assertEqual(os.listdir(outside), ["keep.txt"])
        self.assertFalse(os.path.lexists(os.path.join(self.tmp, *rel.split("/"))))


class UnsavedWorkKept(RestoreTest):
    """A file the restore could not store first is not written over, and the
    undo brings back an edit that the file's size and mtime alone do not show."""

    def test_unreadable_file_is_not_overwritten(self):
        # An unreadable file (a permission problem, an I/O error) cannot be
        # stored in the recovered record, so a restore must not replace it.
        self.write("data.txt", "v1 recorded\n")
        cp = tc.Checkpoints(tc.Config(watch=False, git=False))
        cp.init(self.root, "t")
        cp.save(self.root, "one")
        self.write("data.txt", "precious unsaved edit\n")
        original = tc.PayloadStore.put_file

        def failing(store, src, **kwargs):
            if os.path.basename(src) == "data.txt":
                raise PermissionError(13, "Permission denied", src)
            return original(store, src, **kwargs)

        tc.PayloadStore.put_file = failing
        try:
            try:
                cp.restore(self.root, index=1, apply=True)
            except tc.CheckpointError:
                pass
        finally:
            tc.PayloadStore.put_file = original
        self.assertEqual(self.read("data.txt"), b"precious unsaved edit\n")

    def test_undo_keeps_unsaved_edit_with_sha_reuse(self):
        srv = self.server(env={"TC_SHA_REUSE": "on"})
        path = self.write("a.txt", "version-1\n")
        self.init(srv)
        srv.ok("tc_save", root=self.root, title="one")
        self.write("a.txt", "version-2\n")
        srv.ok("tc_save", root=self.root, title="two")
        st = os.stat(path)
        self.write("a.txt", "unsaved-3\n")
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        res = srv.ok("tc_restore", root=self.root, index=1, apply=True)
        srv.ok("tc_restore", root=self.root, drift_id=res["recovered"], apply=True)
        self.assertEqual(self.read("a.txt"), b"unsaved-3\n")


class InTheWay(RestoreTest):
    """What stands where a recorded file was, or a name that looks like a
    path: a FIFO, a symlink, a folder holding a kept sensitive file, a
    backslash in a file name."""

    @unittest.skipUnless(hasattr(os, "mkfifo"), "needs os.mkfifo")
    def test_fifo_in_place_of_a_recorded_file_does_not_hang(self):
        srv = self.server()
        self.write("pipe", "v1\n")
        self.init(srv)
        srv.ok("tc_save", root=self.root, title="one")
        os.remove(os.path.join(self.root, "pipe"))
        os.mkfifo(os.path.join(self.root, "pipe"))
        srv.ok("tc_save", root=self.root, title="two")
        msg = {"jsonrpc": "2.0", "id": 99, "method": "tools/call", "params": {
            "name": "tc_restore", "arguments": {"root": self.root, "index": 1, "apply": True}}}
        srv.send_raw((json.dumps(msg) + "\n").encode())
        ready, _, _ = select.select([srv.proc.stdout], [], [], 1.5)
        if not ready:
            srv.proc.kill()
            self.fail("tc_restore hangs opening a FIFO for writing")
        reply = json.loads(srv.proc.stdout.readline())
        self.assertEqual(reply["id"], 99)

    def test_directory_with_kept_sensitive_file_does_not_fail_the_restore(self):
        srv = self.server()
        self.write("cfg", "plain file\n")
        self.init(srv)
        srv.ok("tc_save", root=self.root, title="one")
        os.remove(os.path.join(self.root, "cfg"))
        self.write("cfg/.env", "K=1\n")
        self.write("x.txt", "x\n")
        srv.ok("tc_save", root=self.root, title="two")
        res = srv.call("tc_restore", root=self.root, index=1, apply=True)
        self.assertFalse(res.is_error, "one kept .env failed the whole restore: " + res.text)
        self.assertFalse(os.path.exists(os.path.join(self.root, "x.txt")))
        self.assertEqual(self.read("cfg/.env"), b"K=1\n")

    @unittest.skipUnless(can_symlink(), "needs the right to make symlinks")
    def test_symlink_where_a_file_was_is_skipped_not_fatal(self):
        srv = self.server()
        self.write("a.txt", "v1\n")
        self.write("b.txt", "b1\n")
        self.init(srv)
        srv.ok("tc_save", root=self.root, title="one")
        os.remove(os.path.join(self.root, "a.txt"))
        os.symlink(os.path.join(self.tmp, "elsewhere"), os.path.join(self.root, "a.txt"))
        self.write("b.txt", "b2\n")
        srv.ok("tc_save", root=self.root, title="two")
        preview = srv.ok("tc_restore", root=self.root, index=1)
        res = srv.call("tc_restore", root=self.root, index=1, apply=True)
        self.assertFalse(res.is_error, "preview %r, apply: %s" % (preview["plan"], res.text))
        self.assertEqual(self.read("b.txt"), b"b1\n")
        self.assertTrue(os.path.islink(os.path.join(self.root, "a.txt")))

    @unittest.skipIf(os.name == "nt", "a backslash separates folders on Windows: "
                                      "no file name can hold one")
    def test_backslash_in_a_file_name_does_not_redirect_the_restore(self):
        srv = self.server()
        self.write("x/y", "keep me\n")
        self.init(srv)
        srv.ok("tc_save", root=self.root, title="one")
        with open(os.path.join(self.root, "x\\y"), "w") as fh:
            fh.write("a new file whose name holds a backslash\n")
        srv.call("tc_restore", root=self.root, index=1, apply=True)
        self.assertTrue(os.path.isfile(os.path.join(self.root, "x", "y")),
                        "restore deleted x/y, a file the target step contains")
        self.assertEqual(self.read("x/y"), b"keep me\n")


if __name__ == "__main__":
    unittest.main()
