"""Faults of the disk under a real server: a full file system, parts of the
workspace or the store that refuse writes or cannot be read, and errors only
a failing disk gives, injected with strace.

The mounts and immutable files need root; those tests are skipped otherwise.
"""

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

from support import (SCRIPTS, SERVER_COMMAND, Server, WorkspaceTest, is_root, keeps_mode_bits,
                     stored_shas, unnamed_payloads, write)

sys.path.insert(0, SCRIPTS)
import tc  # noqa: E402


def mount_tmpfs(path, size):
    if not is_root():
        return False
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=%s" % size, "tmpfs", path],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc.returncode == 0


class FullDiskTest(unittest.TestCase):

    def setUp(self):
        self.mount = os.path.realpath(tempfile.mkdtemp(prefix="tc-full-"))
        if not mount_tmpfs(self.mount, "2m"):
            os.rmdir(self.mount)
            self.skipTest("mounting a small tmpfs needs root")
        self.addCleanup(os.rmdir, self.mount)
        self.addCleanup(subprocess.run, ["umount", self.mount])
        self.root = os.path.join(self.mount, "ws")
        os.makedirs(self.root)
        self.srv = Server()
        self.srv.initialize()
        self.addCleanup(self.srv.close)

    def fill(self):
        with self.assertRaises(OSError):
            with open(os.path.join(self.root, "filler.bin"), "wb") as fh:
                while True:
                    fh.write(b"x" * 65536)

    def test_full_disk_fails_clearly_and_loses_nothing(self):
        write(self.root, "a.txt", "one\n")
        self.srv.ok("tc_init", root=self.root, name="full")
        self.assertEqual(self.srv.ok("tc_save", root=self.root, title="one")["index"], 1)
        self.fill()
        for name, args in (("tc_save", {"title": "two"}), ("tc_capture", {}),
                           ("tc_restore", {"index": 1, "apply": True})):
            res = self.srv.call(name, root=self.root, **args)
            self.assertTrue(res.is_error, "%s on a full disk: %r" % (name, res))
            self.assertIn("No space left", res.text)
            self.assertIn(self.root, res.text, "which disk is full is not said")
            self.assertNotIn("Traceback", res.text)
        out = os.path.join(self.mount, "out")
        os.mkdir(out)
        res = self.srv.call("tc_export", root=self.root, to=out)
        self.assertTrue(res.is_error, res)
        self.assertIn("The disk is full", res.text)
        self.assertEqual(os.listdir(out), [])
        os.remove(os.path.join(self.root, "filler.bin"))
        health = self.srv.ok("tc_resume", root=self.root)["health"]
        self.assertTrue(health["ok"], health)
        write(self.root, "a.txt", "two\n")
        self.assertEqual(self.srv.ok("tc_save", root=self.root, title="two")["index"], 2)
        self.srv.ok("tc_restore", root=self.root, index=1, apply=True)
        with open(os.path.join(self.root, "a.txt"), "rb") as fh:
            self.assertEqual(fh.read(), b"one\n")

    def test_a_failed_restore_names_the_files_not_their_staging_copies(self):
        store = tempfile.mkdtemp(prefix="tc-store-")
        self.addCleanup(shutil.rmtree, store, True)
        srv = Server(env={"TC_STORE": store})
        srv.initialize()
        self.addCleanup(srv.close)
        write(self.root, "big.bin", os.urandom(300_000).hex())
        srv.ok("tc_init", root=self.root, name="full")
        srv.ok("tc_save", root=self.root, title="one")
        write(self.root, "big.bin", "small\n")
        os.link(os.path.join(self.root, "big.bin"), os.path.join(self.root, "other-name"))
        srv.ok("tc_save", root=self.root, title="two")
        filler = os.path.join(self.mount, "filler.bin")  # beside the workspace
        with self.assertRaises(OSError):
            with open(filler, "wb") as fh:
                while True:
                    fh.write(b"x" * 4096)
        res = srv.call("tc_restore", root=self.root, index=1, apply=True)
        self.assertTrue(res.is_error, res)
        self.assertIn("The disk is full", res.text)
        self.assertNotIn(".tc-", res.text, "a staging name reached the message")
        os.remove(filler)
        self.assertTrue(srv.ok("tc_resume", root=self.root)["health"]["ok"])
        with open(os.path.join(self.root, "big.bin"), "rb") as fh:
            self.assertEqual(fh.read(), b"small\n")

    def test_compress_frees_space_on_a_disk_with_none_left(self):
        write(self.root, "a.txt", "one\n")
        self.srv.ok("tc_init", root=self.root, name="full")
        self.srv.ok("tc_save", root=self.root, title="one")
        for n in range(4):  # drift records holding 200 KB each
            write(self.root, "big.txt", os.urandom(100_000).hex())
            self.assertTrue(self.srv.ok("tc_capture", root=self.root)["captured"])
        self.fill()
        res = self.srv.ok("tc_compress", root=self.root, keep_seconds=0, minimum=0, maximum=1)
        self.assertEqual(res["converted"], 3, res)
        self.assertGreaterEqual(res["bytes_freed"], 3 * 200_000, res)
        shown = self.srv.ok("tc_show", root=self.root, include_drift=True)["drifts"]
        self.assertEqual(sum(not d["restorable"] for d in shown), 3, shown)
        self.assertTrue(shown[-1]["restorable"], "the newest copy is always kept")
        os.remove(os.path.join(self.root, "filler.bin"))
        self.assertTrue(self.srv.ok("tc_resume", root=self.root)["health"]["ok"])

    def test_a_store_that_fills_up_gives_its_space_back(self):
        # The workspace is elsewhere; only the store is on the small disk.
        self.root = os.path.join(os.path.dirname(self.mount), os.path.basename(self.mount) + "-ws")
        os.makedirs(self.root)
        self.addCleanup(shutil.rmtree, self.root, True)
        for n in range(30):
            write(self.root, "f%02d.bin" % n, os.urandom(50_000).hex())  # 3 MB in all
        srv = Server(env={"TC_STORE": os.path.join(self.mount, "store")})
        srv.initialize()
        self.addCleanup(srv.close)
        res = srv.call("tc_init", root=self.root, name="full")
        self.assertTrue(res.is_error, res)
        self.assertIn("No space left", res.text)
        payloads = os.path.join(self.mount, "store", "payload")
        left = [name for _dir, _dirs, names in os.walk(payloads) for name in names]
        self.assertEqual(left, [], "the failed init kept the content it had stored")
        for n in range(15, 30):
            os.remove(os.path.join(self.root, "f%02d.bin" % n))
        srv.ok("tc_init", root=self.root, name="fits")
        self.assertEqual(srv.ok("tc_save", root=self.root, title="one")["index"], 1)


def bind_read_only(path):
    """Make path a read-only bind mount of itself; False when that is not allowed."""
    if not is_root() or not shutil.which("mount"):
        return False
    if subprocess.run(["mount", "--bind", path, path], stdout=subprocess.DEVNULL,
                      stderr=subprocess.DEVNULL).returncode != 0:
        return False
    if subprocess.run(["mount", "-o", "remount,bind,ro", path], stdout=subprocess.DEVNULL,
                      stderr=subprocess.DEVNULL).returncode != 0:
        subprocess.run(["umount", path])
        return False
    return True


def make_immutable(path):
    """chattr +i; False where the file system or the user cannot."""
    if not is_root() or not shutil.which("chattr"):
        return False
    return subprocess.run(["chattr", "+i", path], stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL).returncode == 0


class UnwritablePartsTest(WorkspaceTest):
    """A write refused partway through a tool call: a clean error, and no
    record, task or activation the caller was told did not happen."""

    def state(self, task_id):
        with open(os.path.join(self.store, "tasks", task_id, "state.json")) as fh:
            return json.load(fh)

    def assert_clean_error(self, res, name):
        self.assertTrue(res.is_error, "%s: %r" % (name, res))
        self.assertEqual(len(res.text.strip().splitlines()), 1, res.text)
        self.assertNotIn("Traceback", res.text)
        self.assertNotIn(".tmp-", res.text, "the error names a staging file")

    def test_a_save_refused_after_its_first_records_leaves_no_trace(self):
        srv = self.server(env={"TC_WATCH": "off"})
        self.write("a.txt", "one\n")
        task_id = srv.ok("tc_init", root=self.root, name="refused")["task_id"]
        srv.ok("tc_save", root=self.root, title="one")
        before = self.state(task_id)
        self.write("a.txt", "two, never saved before\n")
        steps = os.path.join(self.store, "tasks", task_id, "steps")
        os.rename(steps, steps + ".aside")
        write(os.path.dirname(steps), "steps", "a file where the folder should be\n")
        for name, args in (("tc_save", {"title": "two"}), ("tc_save", {"title": "two"})):
            self.assert_clean_error(srv.call(name, root=self.root, **args), name)
        self.assertEqual(self.state(task_id), before)
        task_dir = os.path.join(self.store, "tasks", task_id)
        for sub, prefix, key in (("manifest", "m", "last_manifest"),
                                 ("drifts", "d", "last_drift")):
            numbers = [int(n[1:5]) for n in os.listdir(os.path.join(task_dir, sub))]
            self.assertEqual(max(numbers), before[key], "%s left beyond the state" % sub)
        new_sha = hashlib.sha256(b"two, never saved before\n").hexdigest()
        self.assertNotIn(new_sha, stored_shas(self.store), "the failed save kept its content")
        os.remove(steps)
        os.rename(steps + ".aside", steps)
        shown = srv.ok("tc_show", root=self.root)
        self.assertEqual([s["index"] for s in shown["steps"]], [1])
        self.assertEqual(srv.ok("tc_save", root=self.root, title="two")["index"], 2)
        srv.ok("tc_restore", root=self.root, index=1, apply=True)
        self.assertEqual(self.read("a.txt"), b"one\n")
        self.assertTrue(srv.ok("tc_resume", root=self.root)["health"]["ok"])

    def test_an_init_whose_store_pointer_is_refused_changes_nothing(self):
        srv = self.server(env={"TC_WATCH": "off"})
        self.write("a.txt", "one\n")
        os.mkdir(os.path.join(self.root, ".task-checkpoint-store.json"))  # refuses the file
        elsewhere = os.path.join(self.tmp, "elsewhere")
        res = srv.call("tc_init", root=self.root, name="second", store=elsewhere)
        self.assert_clean_error(res, "tc_init")
        self.assertEqual(os.listdir(os.path.join(elsewhere, "tasks")), [],
                         "the refused init left its task behind")
        current = os.path.join(elsewhere, "current.json")
        if os.path.exists(current):
            with open(current) as fh:
                self.assertNotIn(self.root, json.load(fh))
        self.assertFalse(os.path.exists(os.path.join(self.root, ".checkpoints")))
        # The pointer folder moved away, the same init goes through.
        os.rmdir(os.path.join(self.root, ".task-checkpoint-store.json"))
        second = srv.ok("tc_init", root=self.root, name="second", store=elsewhere)["task_id"]
        self.assertEqual(srv.ok("tc_resume", root=self.root)["active_task"], second)

    def test_an_init_that_fails_puts_the_store_pointer_back(self):
        srv = self.server(env={"TC_WATCH": "off"})
        self.write("a.txt", "one\n")
        first_store = os.path.join(self.tmp, "first-store")
        first = srv.ok("tc_init", root=self.root, name="first", store=first_store)["task_id"]
        pointer = os.path.join(self.root, ".task-checkpoint-store.json")
        with open(pointer, "rb") as fh:
            before = fh.read()
        # Another store whose active-task file cannot be replaced.
        other = os.path.join(self.tmp, "other")
        write(other, "x.txt", "x\n")
        second_store = os.path.join(self.tmp, "second-store")
        srv.ok("tc_init", root=other, name="elsewhere", store=second_store)
        current = os.path.join(second_store, "current.json")
        if not make_immutable(current):
            self.skipTest("needs root and a file system with immutable files")
        try:
            res = srv.call("tc_init", root=self.root, name="second", store=second_store)
        finally:
            subprocess.run(["chattr", "-i", current])
        self.assert_clean_error(res, "tc_init")
        with open(pointer, "rb") as fh:
            self.assertEqual(fh.read(), before, "the failed init left the pointer moved")
        resumed = srv.ok("tc_resume", root=self.root)
        self.assertEqual((resumed["active_task"], resumed["status"]), (first, "open"))

    def test_a_save_whose_index_cannot_be_written_is_still_a_save(self):
        srv = self.server(env={"TC_WATCH": "off"})
        self.write("a.txt", "one\n")
        task_id = srv.ok("tc_init", root=self.root, name="index")["task_id"]
        srv.ok("tc_save", root=self.root, title="one")
        task_dir = os.path.join(self.store, "tasks", task_id)
        for name in os.listdir(task_dir):
            if name.startswith("index"):
                os.remove(os.path.join(task_dir, name))
        os.mkdir(os.path.join(task_dir, "index.json"))  # the cache cannot be written
        self.write("a.txt", "two\n")
        self.assertEqual(srv.ok("tc_save", root=self.root, title="two")["index"], 2)
        self.write("a.txt", "three\n")
        self.assertEqual(srv.ok("tc_save", root=self.root, title="three")["index"], 3)
        srv.ok("tc_restore", root=self.root, index=2, apply=True)
        self.assertEqual(self.read("a.txt"), b"two\n")

    def test_init_and_save_on_a_read_only_workspace_with_tc_store(self):
        self.write("a.txt", "one\n")
        store = os.path.join(self.tmp, "store")
        if not bind_read_only(self.root):
            self.skipTest("needs root to bind-mount read-only")
        try:
            srv = self.server(env={"TC_WATCH": "off", "TC_STORE": store})
            task_id = srv.ok("tc_init", root=self.root, name="read-only")["task_id"]
            self.assertEqual(srv.ok("tc_save", root=self.root, title="one")["index"], 1)
            resumed = srv.ok("tc_resume", root=self.root)
            self.assertEqual(resumed["active_task"], task_id)
            self.assertEqual(os.listdir(os.path.join(store, "tasks")), [task_id])
        finally:
            subprocess.run(["umount", self.root])
        self.assertEqual(sorted(os.listdir(self.root)), ["a.txt"])

    def test_a_restore_refused_by_a_read_only_record_folder_changes_nothing(self):
        srv = self.server(env={"TC_WATCH": "off"})
        self.write("a.txt", "one\n")
        task_id = srv.ok("tc_init", root=self.root, name="ro drifts")["task_id"]
        srv.ok("tc_save", root=self.root, title="one")
        self.write("a.txt", "two\n")
        srv.ok("tc_save", root=self.root, title="two")
        self.write("a.txt", "unsaved\n")
        drifts = os.path.join(self.store, "tasks", task_id, "drifts")
        if not bind_read_only(drifts):
            self.skipTest("needs root to bind-mount read-only")
        try:
            res = srv.call("tc_restore", root=self.root, index=1, apply=True)
            self.assert_clean_error(res, "tc_restore")
            self.assertIn("nothing was changed", res.text)
            self.assertEqual(self.read("a.txt"), b"unsaved\n")
            self.assertFalse(os.listdir(os.path.join(self.store, "journal"))
                             if os.path.isdir(os.path.join(self.store, "journal")) else [],
                             "the restore left a journal it could not roll back")
            self.assertTrue(srv.ok("tc_resume", root=self.root)["health"]["ok"])
        finally:
            subprocess.run(["umount", drifts])
        srv.ok("tc_restore", root=self.root, index=1, apply=True)
        self.assertEqual(self.read("a.txt"), b"one\n")

    def test_an_immutable_active_pointer_still_allows_what_needs_no_change(self):
        srv = self.server(env={"TC_WATCH": "off"})
        self.write("a.txt", "one\n")
        side = srv.ok("tc_init", root=self.root, name="side")["task_id"]
        main = srv.ok("tc_init", root=self.root, name="main")["task_id"]
        current = os.path.join(self.store, "current.json")
        if not make_immutable(current):
            self.skipTest("needs root and a file system with immutable files")
        try:
            self.assert_clean_error(srv.call("tc_switch", root=self.root, task_id=side),
                                    "tc_switch")
            self.assertEqual(srv.ok("tc_switch", root=self.root, task_id=main)["status"], "open")
            self.assertEqual(srv.ok("tc_save", root=self.root, title="one")["index"], 1)
            self.assertEqual((self.state(main)["status"], self.state(side)["status"]),
                             ("open", "suspended"))
        finally:
            subprocess.run(["chattr", "-i", current])

    @unittest.skipUnless(hasattr(os, "geteuid") and os.geteuid() == 0
                         and shutil.which("mount"), "needs root to bind-mount read-only")
    def test_read_only_workspace_keeps_read_tools_working(self):
        store = os.path.join(self.tmp, "store")
        srv = self.server(env={"TC_STORE": store})
        self.write("a.txt", "1\n")
        srv.ok("tc_init", root=self.root, name="t")
        srv.ok("tc_save", root=self.root, title="one")
        self.write("a.txt", "2\n")
        self.write("c.txt", "new\n")
        srv.ok("tc_save", root=self.root, title="two")
        other = os.path.join(self.tmp, "other")
        write(other, "a.txt", "from elsewhere\n")
        out = os.path.join(self.tmp, "out")
        os.mkdir(out)
        elsewhere = self.server(env={"TC_STORE": os.path.join(self.tmp, "store2")})
        elsewhere.ok("tc_init", root=other, name="other")
        package = elsewhere.ok("tc_export", root=other, to=out)["path"]
        if subprocess.run(["mount", "--bind", self.root, self.root],
                          stderr=subprocess.DEVNULL).returncode != 0:
            self.skipTest("bind mounts are not allowed here")
        try:
            subprocess.run(["mount", "-o", "remount,bind,ro", self.root], check=True)
            failed = srv.call("tc_restore", root=self.root, index=1, apply=True)
            self.assertTrue(failed.is_error)
            self.assertNotIn("could not be fully undone", failed.text,
                             "nothing was changed, yet the restore says it could not be undone")
            self.assertIn("read-only: make it writable", failed.text)
            resumed = srv.call("tc_resume", root=self.root)
            self.assertFalse(resumed.is_error, "read-only tc_resume fails: " + resumed.text)
            failed = srv.call("tc_import", root=self.root, package=package)
            self.assertTrue(failed.is_error)
            self.assertIn("nothing was changed: Read-only file system: 'a.txt'", failed.text)
        finally:
            subprocess.run(["umount", self.root])


def traced(command, *strace_args):
    """command run under strace with strace_args (fault injection), or None
    where strace is missing or may not trace."""
    if not shutil.which("strace"):
        return None
    probe = subprocess.run(["strace", "-f", "-qq", "-o", os.devnull, "true"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if probe.returncode != 0:
        return None
    return ["strace", "-f", "-qq", "-o", os.devnull] + list(strace_args) + list(command)


class UnreadableFolderTest(WorkspaceTest):
    """A folder the scan cannot list (a permission, an I/O error) is unknown,
    not deleted: its files keep their last recorded state, and no restore
    removes or overwrites them unseen."""

    @contextlib.contextmanager
    def unlistable(self, path):
        """A second server on the same store that cannot list path: strace
        fails every open of it (root lists any folder), else permission bits
        (where chmod sets them: not on Windows)."""
        if not is_root() and keeps_mode_bits():
            mode = os.stat(path).st_mode
            os.chmod(path, 0o300)
            try:
                yield self.server(env={"TC_WATCH": "off"})
            finally:
                os.chmod(path, mode)
            return
        command = traced(SERVER_COMMAND, "-P", path, "-P", path + "/", "-e", "trace=openat,open",
                         "-e", "inject=openat,open:error=EACCES")
        if command is None:
            self.skipTest("needs strace (or a user that permission bits apply to)")
        srv = self.server(env={"TC_WATCH": "off"}, command=command)
        try:
            yield srv
        finally:
            srv.close()

    def traced_server(self, *strace_args):
        command = traced(SERVER_COMMAND, *strace_args)
        if command is None:
            self.skipTest("needs strace")
        return self.server(env={"TC_WATCH": "off"}, command=command)

    def setUp(self):
        super().setUp()
        self.write("docs/a.txt", "a one\n")
        self.write("src/b.txt", "b one\n")
        self.srv = self.server(env={"TC_WATCH": "off"})
        self.srv.ok("tc_init", root=self.root, name="unreadable")
        self.srv.ok("tc_save", root=self.root, title="one")

    def test_save_and_capture_keep_what_they_cannot_see(self):
        self.write("src/b.txt", "b two\n")
        with self.unlistable(os.path.join(self.root, "docs")) as blind:
            captured = blind.ok("tc_capture", root=self.root)
            self.assertEqual((captured["modified"], captured["deleted"]), (["src/b.txt"], []))
            saved = blind.ok("tc_save", root=self.root, title="two")
            self.assertIn("docs", [item["path"] for item in saved["skipped_paths"]])
        self.srv.ok("tc_restore", root=self.root, index=1, apply=True)
        self.assertEqual(self.read("src/b.txt"), b"b one\n")
        self.srv.ok("tc_restore", root=self.root, index=saved["index"], apply=True)
        self.assertEqual((self.read("docs/a.txt"), self.read("src/b.txt")),
                         (b"a one\n", b"b two\n"))

    def test_resume_of_a_root_it_cannot_list_does_not_say_nothing_is_unrecorded(self):
        with self.unlistable(self.root) as blind:
            resume = blind.ok("tc_resume", root=self.root)
        self.assertEqual(resume["skipped"][0]["path"], ".")
        self.assertIn("Not yet recorded: unknown (the workspace could not be read: "
                      "Permission denied)", resume["handoff"])
        self.assertNotIn("Not yet recorded: none", resume["handoff"])
        # A folder inside it that cannot be listed is named: what changed there is unknown.
        with self.unlistable(os.path.join(self.root, "docs")) as blind:
            resume = blind.ok("tc_resume", root=self.root)
        self.assertIn("Not yet recorded: none (not read: docs/)", resume["handoff"])

    def test_a_restore_leaves_an_unseen_folder_and_its_undo_keeps_it(self):
        self.write("docs/a.txt", "unsaved a\n")
        self.write("docs/new.txt", "never recorded\n")
        self.write("src/b.txt", "unsaved b\n")
        with self.unlistable(os.path.join(self.root, "docs")) as blind:
            res = blind.ok("tc_restore", root=self.root, index=1, apply=True)
        self.assertEqual(self.read("src/b.txt"), b"b one\n")
        self.assertEqual(self.read("docs/a.txt"), b"unsaved a\n", "an unseen file was written")
        # The undo record did not see docs/: restoring it leaves docs/ alone.
        preview = self.srv.ok("tc_restore", root=self.root, drift_id=res["recovered"])
        self.assertEqual(preview["plan"]["to_delete"], [])
        self.assertIn("docs/new.txt", [item["path"] for item in preview["plan"]["unrestorable"]])
        self.srv.ok("tc_restore", root=self.root, drift_id=res["recovered"], apply=True)
        self.assertEqual((self.read("src/b.txt"), self.read("docs/a.txt"),
                          self.read("docs/new.txt")),
                         (b"unsaved b\n", b"unsaved a\n", b"never recorded\n"))

    def test_a_listing_that_breaks_off_makes_the_folder_unknown(self):
        self.write("src/b.txt", "b two\n")
        docs = os.path.join(self.root, "docs")
        blind = self.traced_server("-P", docs, "-P", docs + "/", "-e", "trace=getdents64",
                                   "-e", "inject=getdents64:error=EIO")
        saved = blind.ok("tc_save", root=self.root, title="two")
        self.assertIn({"path": "docs", "reason": "unreadable directory: Input/output error"},
                      saved["skipped_paths"])
        self.srv.ok("tc_restore", root=self.root, index=1, apply=True)
        self.srv.ok("tc_restore", root=self.root, index=saved["index"], apply=True)
        self.assertEqual((self.read("docs/a.txt"), self.read("src/b.txt")),
                         (b"a one\n", b"b two\n"))

    def test_a_listing_cut_short_leaves_the_whole_folder_unknown(self):
        names = ["docs/f%04d.txt" % n for n in range(1200)] + ["docs/sub/x.txt"]
        for rel in names:
            self.write(rel, "first\n")
        self.srv.ok("tc_capture", root=self.root)
        for rel in names[:-1]:
            self.write(rel, "second\n")
        os.remove(os.path.join(self.root, "docs", "sub", "x.txt"))
        docs = os.path.join(self.root, "docs")
        # The first batch of entries comes through; the listing then fails.
        blind = self.traced_server("-P", docs, "-P", docs + "/", "-e", "trace=getdents64",
                                   "-e", "inject=getdents64:error=EIO:when=2+")
        captured = blind.ok("tc_capture", root=self.root)
        self.assertIn("docs", [item["path"] for item in captured["skipped_paths"]])
        self.assertEqual([p for p in captured["modified"] + captured["deleted"]
                          if p.startswith("docs/")], [], "a half-read folder was recorded")

    def test_a_restore_writes_a_missing_file_its_record_did_not_see(self):
        docs = os.path.join(self.root, "docs")
        with self.unlistable(docs) as blind:
            saved = blind.ok("tc_save", root=self.root, title="two")
        # Saved again where docs/ can be read: a new step, which did see it.
        again = self.srv.ok("tc_save", root=self.root, title="two")
        self.assertFalse(again["idempotent"], again)
        shutil.rmtree(docs)
        for index in (saved["index"], again["index"]):
            self.srv.ok("tc_restore", root=self.root, index=index, apply=True)
            self.assertEqual(self.read("docs/a.txt"), b"a one\n", "step %d" % index)
            shutil.rmtree(docs)

    def test_a_row_kept_unseen_is_read_again_once_it_can_be(self):
        task_id = self.srv.ok("tc_show", root=self.root)["task_id"]
        # The racy case: docs/a.txt changed within the clock tick its index
        # row was written in (same size), so the index cannot vouch for it.
        self.write("docs/a.txt", "a two\n")
        st = os.lstat(os.path.join(self.root, "docs", "a.txt"))
        records = tc.TaskRecords(self.store, task_id)
        doc = records.read_index()
        doc["files"]["docs/a.txt"] = doc["files"]["docs/a.txt"]._replace(
            size=st.st_size, mtime_ns=st.st_mtime_ns, ctime_ns=st.st_ctime_ns, ino=st.st_ino,
            dev=st.st_dev)
        for name in os.listdir(records.directory):
            if name.startswith("index"):
                os.remove(os.path.join(records.directory, name))
        with open(records.index_path, "w") as fh:
            json.dump({"stamp_ns": st.st_mtime_ns, "files": doc["files"]}, fh)
        time.sleep(1.1)  # the next index is stamped clear of the file's times
        with self.unlistable(os.path.join(self.root, "docs")) as blind:
            blind.ok("tc_capture", root=self.root)
        saved = self.srv.ok("tc_save", root=self.root, title="two")
        self.write("docs/a.txt", "a three, another size\n")
        self.srv.ok("tc_restore", root=self.root, index=saved["index"], apply=True)
        self.assertEqual(self.read("docs/a.txt"), b"a two\n",
                         "the step kept the old content of a file it could read")

    def test_a_file_gone_before_it_was_read_is_deleted_not_kept(self):
        path = os.path.join(self.root, "src", "b.txt")
        # The scan sees src/b.txt; opening it finds nothing (removed meanwhile).
        blind = self.traced_server("-P", path, "-e", "trace=openat,open",
                                   "-e", "inject=openat,open:error=ENOENT")
        captured = blind.ok("tc_capture", root=self.root)
        self.assertEqual(captured["deleted"], [], "nothing changed yet")
        self.write("src/b.txt", "b two, a new size\n")
        captured = blind.ok("tc_capture", root=self.root)
        self.assertEqual(captured["deleted"], ["src/b.txt"])

    def test_an_unlistable_workspace_is_an_error_not_an_empty_one(self):
        self.write("src/b.txt", "unsaved b\n")
        with self.unlistable(self.root) as blind:
            for name, args in (("tc_restore", {"index": 1, "apply": True}),
                               ("tc_save", {"title": "two"}), ("tc_capture", {})):
                res = blind.call(name, root=self.root, **args)
                self.assertTrue(res.is_error, "%s: %r" % (name, res))
                self.assertNotIn("Traceback", res.text)
            resumed = blind.ok("tc_resume", root=self.root)
            self.assertEqual((resumed["head"], resumed["drift_paths"]), (1, []))
        self.assertEqual(self.read("src/b.txt"), b"unsaved b\n")
        shown = self.srv.ok("tc_show", root=self.root, include_drift=True)
        self.assertEqual([step["index"] for step in shown["steps"]], [1])


class UnprivilegedServerTest(WorkspaceTest):
    """Permission bits that apply to the server's user (as root the server
    runs as nobody): a file it may not read is listed as skipped, never as
    unsaved work; a folder it may not write is named in full in the error."""

    def unprivileged_server(self):
        command = list(SERVER_COMMAND)
        if is_root():
            if not shutil.which("setpriv"):
                self.skipTest("running as root without setpriv: permissions are not enforced")
            command = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] + command
            probe = subprocess.run(command[:5] + ["-c", "import sys; sys.path.insert(0, %r); "
                                                  "import tc" % SCRIPTS],
                                   capture_output=True, text=True, timeout=60)
            if probe.returncode != 0:
                self.skipTest("this interpreter cannot run as an unprivileged user: %s"
                              % probe.stderr.strip()[-200:])
            os.chmod(self.tmp, 0o755)
            for dirpath, _dirs, names in os.walk(self.root):
                for path in [dirpath] + [os.path.join(dirpath, n) for n in names]:
                    os.chown(path, 65534, 65534)
        return self.server(env={"TC_WATCH": "off"}, command=command)

    @unittest.skipUnless(keeps_mode_bits(), "needs permission bits that stop a read")
    def test_an_unreadable_file_is_skipped_not_reported_as_unsaved(self):
        self.write("a.txt", "one\n")
        self.write("locked.txt", "nobody may read this\n", mode=0o200)
        srv = self.unprivileged_server()
        srv.ok("tc_init", root=self.root, name="locked")
        saved = srv.ok("tc_save", root=self.root, title="one")
        self.assertIn("locked.txt", [item["path"] for item in saved["skipped_paths"]])
        resume = srv.ok("tc_resume", root=self.root)
        self.assertEqual(resume["drift_paths"], [])
        self.assertEqual(resume["changed_since_step"], [])
        self.assertIn("locked.txt", [item["path"] for item in resume["skipped"]])
        self.assertNotIn("locked.txt", resume["handoff"])
        self.write("a.txt", "two\n")  # a real change is still reported
        self.assertEqual(srv.ok("tc_resume", root=self.root)["drift_paths"], ["a.txt"])

    @unittest.skipUnless(keeps_mode_bits(), "needs permission bits that stop a write")
    def test_a_restore_refused_by_a_folder_names_the_whole_path(self):
        self.write("lk/in/kept.txt", "one\n")
        srv = self.unprivileged_server()
        srv.ok("tc_init", root=self.root, name="perm")
        srv.ok("tc_save", root=self.root, title="one")
        new = self.write("lk/in/new.txt", "made after step one\n")
        if is_root():
            os.chown(new, 65534, 65534)
        folder = os.path.join(self.root, "lk", "in")
        os.chmod(folder, 0o555)
        try:
            res = srv.call("tc_restore", root=self.root, index=1, apply=True)
        finally:
            os.chmod(folder, 0o755)
        self.assertTrue(res.is_error, res)
        self.assertIn(repr(os.path.join(folder, "new.txt")), res.text)
        self.assertEqual(self.read("lk/in/new.txt"), b"made after step one\n")


class InjectedFaultTest(WorkspaceTest):
    """Errors only a failing disk gives, injected with strace."""

    def faulty_server(self, *strace_args, cwd=None):
        command = traced(SERVER_COMMAND, *strace_args)
        if command is None:
            self.skipTest("needs strace")
        return self.server(env={"TC_WATCH": "off"}, command=command, cwd=cwd)

    def test_a_failed_flush_fails_the_save_and_records_nothing(self):
        srv = self.server(env={"TC_WATCH": "off"})
        self.write("a.txt", "one\n")
        srv.ok("tc_init", root=self.root, name="fsync")
        srv.ok("tc_save", root=self.root, title="one")
        for n in range(40):
            self.write("many/f%02d.txt" % n, "new content %d\n" % n)
        faulty = self.faulty_server("-e", "trace=fsync,fdatasync,syncfs",
                                    "-e", "inject=fsync,fdatasync,syncfs:error=EIO")
        res = faulty.call("tc_save", root=self.root, title="two")
        self.assertTrue(res.is_error, res)
        self.assertIn("Input/output error", res.text)
        self.assertIn("check the disk", res.text)
        self.assertNotIn("Traceback", faulty.stderr)
        shown = srv.ok("tc_show", root=self.root)
        self.assertEqual([step["index"] for step in shown["steps"]], [1])
        self.assertTrue(srv.ok("tc_resume", root=self.root)["health"]["ok"])
        self.assertEqual(srv.ok("tc_save", root=self.root, title="two")["index"], 2)

    def test_an_init_or_import_the_disk_fails_keeps_no_content(self):
        for n in range(20):
            self.write("f%02d.txt" % n, "content %d\n" % n)
        store = os.path.join(self.tmp, "store")
        # A file in the server's working directory named like the content
        # the import brings: a failed import must not take it for its own.
        decoy = os.path.join(self.tmp, hashlib.sha256(b"from elsewhere\n").hexdigest())
        write(self.tmp, os.path.basename(decoy), "not the store's\n")
        faulty = self.faulty_server("-e", "trace=fsync,fdatasync,syncfs",
                                    "-e", "inject=fsync,fdatasync,syncfs:error=EIO",
                                    cwd=self.tmp)
        res = faulty.call("tc_init", root=self.root, name="flush fails", store=store)
        self.assertTrue(res.is_error, res)
        self.assertEqual(stored_shas(store), {}, "the failed init kept its content")
        tasks = os.path.join(store, "tasks")
        self.assertEqual(os.listdir(tasks) if os.path.isdir(tasks) else [], [])
        # A package to import, made where the disk works.
        other = os.path.join(self.tmp, "other")
        write(other, "g.txt", "from elsewhere\n")
        srv = self.server(env={"TC_WATCH": "off"})
        srv.ok("tc_init", root=other, name="elsewhere", store=os.path.join(self.tmp, "s2"))
        out = os.path.join(self.tmp, "out")
        os.mkdir(out)
        package = srv.ok("tc_export", root=other, to=out)["path"]
        store = os.path.join(self.root, ".checkpoints")  # no pointer was left behind
        res = faulty.call("tc_import", root=self.root, package=package)
        self.assertTrue(res.is_error, res)
        self.assertEqual(stored_shas(store), {}, "the failed import kept its content")
        journal = os.path.join(store, "journal")
        self.assertEqual(os.listdir(journal) if os.path.isdir(journal) else [], [])
        self.assertFalse(os.path.exists(os.path.join(self.root, "g.txt")))
        self.assertTrue(os.path.exists(decoy), "the failed import removed a file outside")

    def test_a_full_disk_is_called_full_when_the_store_is_new(self):
        self.write("a.txt", "one\n")
        lock = os.path.join(self.root, ".checkpoints", "state.lock")
        faulty = self.faulty_server("-P", lock, "-e", "trace=openat,open",
                                    "-e", "inject=openat,open:error=ENOSPC")
        res = faulty.call("tc_init", root=self.root, name="no room")
        self.assertTrue(res.is_error, res)
        self.assertIn("The disk is full", res.text)
        self.assertNotIn("read-only", res.text)

    def test_a_failed_flush_of_the_state_folder_fails_the_save(self):
        srv = self.server(env={"TC_WATCH": "off"})
        self.write("a.txt", "one\n")
        task_id = srv.ok("tc_init", root=self.root, name="folder flush")["task_id"]
        srv.ok("tc_save", root=self.root, title="one")
        self.write("a.txt", "two\n")
        # Only the fsync of the folder that holds state.json, after its rename.
        task_dir = os.path.join(self.store, "tasks", task_id)
        faulty = self.faulty_server("-P", task_dir, "-e", "trace=fsync",
                                    "-e", "inject=fsync:error=EIO")
        res = faulty.call("tc_save", root=self.root, title="two")
        self.assertTrue(res.is_error, res)
        self.assertIn("Input/output error", res.text)

    def test_a_workspace_on_a_share_that_cannot_flush_folders_takes_an_external_store(self):
        self.write("a.txt", "one\n")
        store = os.path.join(self.tmp, "store")
        # The workspace folder refuses fsync, as some network shares do for
        # folders: the pointer file in it is not a store record, so the flush
        # of its folder is best effort, and the store's own records are strict.
        faulty = self.faulty_server("-P", self.root, "-e", "trace=fsync",
                                    "-e", "inject=fsync:error=EIO")
        res = faulty.call("tc_init", root=self.root, name="share", store=store)
        self.assertFalse(res.is_error, res.text)
        with open(os.path.join(self.root, ".task-checkpoint-store.json"), encoding="utf-8") as fh:
            self.assertEqual(json.load(fh)["store"], store)
        self.assertEqual(faulty.ok("tc_save", root=self.root, title="one")["index"], 1)

    def test_a_save_whose_state_cannot_be_read_after_its_snapshot_keeps_no_content(self):
        srv = self.server(env={"TC_WATCH": "off"})
        self.write("a.txt", "one\n")
        task_id = srv.ok("tc_init", root=self.root, name="state read")["task_id"]
        srv.ok("tc_save", root=self.root, title="one")
        self.write("new/b.txt", "stored by the snapshot\n")
        self.write("new/c.txt", "and this\n")
        state = os.path.join(self.store, "tasks", task_id, "state.json")
        # The fourth read of the state in the call comes after the snapshot.
        faulty = self.faulty_server("-P", state, "-e", "trace=openat,open",
                                    "-e", "inject=openat,open:error=EACCES:when=4")
        res = faulty.call("tc_save", root=self.root, title="two")
        self.assertTrue(res.is_error, res)
        self.assertIn("state.json", res.text)
        self.assertEqual(unnamed_payloads(self.store), [])
        self.assertEqual(srv.ok("tc_save", root=self.root, title="two")["index"], 2)

    def test_a_lock_that_fails_to_unlock_does_not_fail_finished_work(self):
        srv = self.server(env={"TC_WATCH": "off"})
        self.write("a.txt", "one\n")
        srv.ok("tc_init", root=self.root, name="unlock")
        srv.ok("tc_save", root=self.root, title="one")
        self.write("a.txt", "two\n")
        faulty = self.faulty_server("-e", "trace=flock",
                                    "-e", "inject=flock:error=EIO:when=2+")
        res = faulty.call("tc_save", root=self.root, title="two")
        self.assertFalse(res.is_error, res.text)
        self.assertEqual(res.data["index"], 2)


class BrokenLibraryTest(WorkspaceTest):
    """A module of the standard library that cannot be loaded while the
    server runs (a file descriptor limit, a Python upgraded underneath)."""

    def test_a_failed_import_fails_the_call_and_the_server_serves_on(self):
        # Shadows that fail to load: the thread pool a batch of fsyncs uses,
        # and the module the error handler formats tracebacks with.
        shadow = os.path.join(self.tmp, "shadow")
        write(shadow, "concurrent/__init__.py", "raise ImportError('not loadable')\n")
        write(shadow, "traceback.py", "raise ImportError('not loadable')\n")
        srv = self.server(env={"TC_WATCH": "off", "PYTHONPATH": shadow})
        self.write("a.txt", "one\n")
        srv.ok("tc_init", root=self.root, name="broken library")
        reply = srv.request("tools/call", {"name": "tc_save",
                                           "arguments": {"root": self.root, "title": "one"}})
        self.assertIn("error", reply)
        self.assertEqual(reply["error"]["code"], -32603)
        self.assertIn("ImportError", reply["error"]["message"])
        self.assertIsNone(srv.proc.poll(), "the server exited")
        shown = srv.ok("tc_show", root=self.root)
        self.assertEqual(shown["steps"], [])
        log = os.path.join(self.store, "server.log")
        with open(log, encoding="utf-8") as fh:
            self.assertIn("not loadable", fh.read())


class RemoveFileTest(unittest.TestCase):

    @unittest.skipIf(os.name != "posix" or os.geteuid() == 0,
                     "needs permission bits that apply to the user")
    def test_a_file_that_could_not_be_removed_is_reported(self):
        folder = tempfile.mkdtemp(prefix="tc-remove-")
        self.addCleanup(shutil.rmtree, folder, True)
        path = os.path.join(folder, "kept.txt")
        write(folder, "kept.txt", "still here\n")
        os.chmod(folder, 0o600)  # no search permission: neither unlink nor lstat
        self.addCleanup(os.chmod, folder, 0o700)
        with self.assertRaises(PermissionError):
            tc.remove_file(path)
        os.chmod(folder, 0o700)
        self.assertTrue(os.path.exists(path))
        self.assertFalse(tc.remove_file(os.path.join(folder, "never-there")))
        self.assertTrue(tc.remove_file(path))


if __name__ == "__main__":
    unittest.main()
