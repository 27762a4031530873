"""Regression tests for defects found in review: data loss, contract gaps, robustness."""

import json
import os
import select
import shutil
import subprocess
import sys
import threading
import time
import unittest

from support import SCRIPTS, WorkspaceTest, can_symlink, make_git_repo, git, sha, write, read

sys.path.insert(0, SCRIPTS)
import tc  # noqa: E402


def make_package(directory, task_id, files, step=None):
    """A hand-made handoff package: files is [(path, bytes, mode)]."""
    pkg = os.path.join(directory, "%s-handoff" % task_id)
    entries = []
    for rel, data, mode in files:
        write(pkg, "files/" + rel, data)
        entries.append({"path": rel, "sha256": sha(data), "size": len(data), "mode": mode})
    desc = {"format": 1, "task": {"task_id": task_id, "name": "imported"}, "step": step,
            "files": entries, "filtered": [], "history": []}
    with open(os.path.join(pkg, "handoff.json"), "w", encoding="utf-8") as fh:
        json.dump(desc, fh)
    return pkg


def store_holds(store, data):
    path = os.path.join(store, "payload", sha(data)[:2], sha(data))
    return os.path.exists(path)


class ImportTests(WorkspaceTest):

    def test_import_never_writes_into_git_or_sensitive_files(self):
        os.makedirs(os.path.join(self.root, ".git", "hooks"))
        self.write(".env", "SECRET=mine\n")
        pkg = make_package(self.tmp, "evil-1", [
            (".git/hooks/pre-commit", b"#!/bin/sh\necho owned\n", 0o755),
            (".env", b"SECRET=theirs\n", 0o644),
            ("ok.txt", b"ok\n", 0o644)])
        srv = self.server()
        srv.call("tc_import", root=self.root, package=pkg)
        self.assertFalse(os.path.exists(os.path.join(self.root, ".git", "hooks", "pre-commit")),
                         "a package wrote a git hook")
        self.assertEqual(self.read(".env"), b"SECRET=mine\n", "a package overwrote .env")
        self.assertFalse(store_holds(self.store, b"SECRET=mine\n"),
                         "the content of .env reached the store")

    def test_import_does_not_silently_overwrite_unsaved_work(self):
        pkg = make_package(self.tmp, "other-1", [("notes.txt", b"from the package\n", 0o644)],
                           step={"index": 1, "title": "one"})
        self.write("notes.txt", "my own unsaved work\n")
        srv = self.server()
        res = srv.call("tc_import", root=self.root, package=pkg)
        if res.is_error:
            self.assertEqual(self.read("notes.txt"), b"my own unsaved work\n")
            return
        if self.read("notes.txt") == b"my own unsaved work\n":
            return
        # Overwritten: some drift record must bring the old bytes back.
        drifts = srv.ok("tc_show", root=self.root, include_drift=True)["drifts"]
        for drift in drifts:
            if srv.call("tc_restore", root=self.root, drift_id=drift["id"],
                        apply=True).is_error:
                continue
            if self.read("notes.txt") == b"my own unsaved work\n":
                return
        self.fail("tc_import replaced notes.txt and nothing can bring the old bytes back")

    def test_package_entries_that_would_damage_the_store_are_refused(self):
        # Whatever a package says ends up in the store's records: a content
        # name that is a path, a size that is not a number, a history entry of
        # the wrong form, a step without a title. Each is refused up front.
        srv = self.server()

        def edited(n, change):
            pkg = make_package(os.path.join(self.tmp, "bad%d" % n), "bad-%d" % n,
                               [("a.txt", b"a\n", 0o644)], step={"index": 1, "title": "one"})
            path = os.path.join(pkg, "handoff.json")
            with open(path, "rb") as fh:
                desc = json.loads(fh.read())
            change(desc)
            with open(path, "w", encoding="utf-8") as fh:
                json.dump(desc, fh)
            return pkg

        escape = "../../../../" + os.path.basename(self.tmp) + "-escaped"
        cases = [
            lambda d: d["files"][0].update(sha256=escape),
            lambda d: d["files"][0].update(size="1"),
            lambda d: d.update(history=[{"step": {"index": 1, "title": "one"},
                                         "files": {"a.txt": ["s", "ab" * 32, 2, 420, 0]}}]),
            lambda d: d.update(history=[{"step": {"index": 1, "title": "one"},
                                         "files": {"a.txt": ["f", sha(b"a\n"), -2, 420, 0]}}]),
            lambda d: d.update(step={"index": 1}),
            lambda d: d.update(step={"index": 1, "title": "one", "verified": "yes"}),
            lambda d: d.update(history=[{"step": {"index": 2, "title": "two"}, "files": {}}]),
            lambda d: d.update(history=[{"step": {"index": 1, "title": "one"}, "files": {}}] * 2),
            # Fields that look right to a lax reader and would be recorded wrong.
            lambda d: d["files"][0].update(size=999999),
            lambda d: d.update(history=[{"step": {"index": 1, "title": "one"},
                                         "files": {"a.txt": ["f", sha(b"a\n"), 5, 420, 0]}}]),
            lambda d: d["task"].update(exclude="zq"),
            lambda d: d.update(format=True),
            lambda d: d.update(format=1.0),
            lambda d: d["task"].update(task_id=d["task"]["task_id"] + "\n"),
        ]
        for n, change in enumerate(cases):
            with self.subTest(case=n):
                res = srv.call("tc_import", root=self.root, package=edited(n, change))
                self.assertTrue(res.is_error, res)
                self.assertRegex(res.text, "malformed|twice|lacks|gives|size its content"
                                 "|format|exclude must be|not a valid task id")
                self.assertFalse(os.path.exists(os.path.join(self.store, "tasks", "bad-%d" % n)))
                self.assertFalse(os.path.exists(self.root + "/a.txt"))
        self.assertEqual([n for n in os.listdir(os.path.dirname(self.tmp))
                          if n.endswith("-escaped")], [])

    def test_a_folder_that_is_no_package_is_named_so(self):
        plain = os.path.join(self.tmp, "project")
        write(plain, "src/a.py", "print(1)\n")
        if can_symlink():  # not every Windows user may make one
            os.symlink("src/a.py", os.path.join(plain, "link.py"))
        res = self.server().call("tc_import", root=self.root, package=plain)
        self.assertTrue(res.is_error, res)
        self.assertIn("has no handoff.json", res.text)

    @unittest.skipUnless(can_symlink(), "needs the right to make symlinks")
    def test_a_linked_package_description_is_refused_unread(self):
        pkg = make_package(self.tmp, "linked-1", [("a.txt", b"a\n", 0o644)])
        described = os.path.join(pkg, "handoff.json")
        os.rename(described, os.path.join(self.tmp, "elsewhere.json"))
        os.symlink(os.path.join(self.tmp, "elsewhere.json"), described)
        res = self.server().call("tc_import", root=self.root, package=pkg)
        self.assertTrue(res.is_error, res)
        self.assertIn("symlink", res.text)
        self.assertFalse(os.path.exists(os.path.join(self.root, "a.txt")))

    def test_malformed_package_step_is_a_tool_error(self):
        srv = self.server()
        for n, step in enumerate(({"index": "1", "title": "x"}, {"title": "no index"},
                                  ["x"], {"index": -3, "title": "x"})):
            pkg = make_package(os.path.join(self.tmp, "p%d" % n), "imp-%d" % n,
                               [("a.txt", b"a", 0o644)], step=step)
            reply = srv.request("tools/call", {"name": "tc_import", "arguments": {
                "root": self.root, "package": pkg}})
            self.assertNotIn("error", reply, (step, reply))
            self.assertTrue(reply["result"]["isError"], (step, reply))


class RestoreTests(WorkspaceTest):

    def init(self, srv):
        return srv.ok("tc_init", root=self.root, name="review")["task_id"]

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

    def test_damaged_index_cache_does_not_block_saves(self):
        srv = self.server()
        self.write("a.txt", "1\n")
        task = self.init(srv)
        srv.ok("tc_save", root=self.root, title="one")
        with open(os.path.join(self.store, "tasks", task, "index.json"), "wb"):
            pass  # what an index written without fsync can be after a power cut
        self.write("a.txt", "2\n")
        res = srv.call("tc_save", root=self.root, title="two")
        self.assertFalse(res.is_error, res.text)


class FolderSwappedAfterTheScanTests(WorkspaceTest):
    """A folder replaced by a link to elsewhere between the scan and the
    reads (another process racing the save) must not bring the files over
    there into the store. The swap is made right after the real scan."""

    @unittest.skipUnless(can_symlink(), "needs the right to make symlinks")
    def test_a_save_does_not_store_what_a_swapped_folder_points_at(self):
        outside = os.path.join(self.tmp, "outside")
        os.makedirs(outside)
        with open(os.path.join(outside, "a.txt"), "w") as fh:
            fh.write("OUTSIDE SECRET\n")
        self.write("sub/a.txt", "inside one\n")
        self.write("sub/b.txt", "kept\n")
        cp = tc.Checkpoints(tc.Config(watch=False, git=False))
        cp.init(self.root, "swap")
        cp.save(self.root, "one")
        self.write("sub/a.txt", "inside two, longer\n")  # must be read again
        self.outside = outside
        self.after_scan(self.swap_sub)
        saved = cp.save(self.root, "two")
        reasons = {e["path"]: e["reason"] for e in saved["skipped_paths"]}
        self.assertIn("sub/a.txt", reasons)
        self.assertIn("outside the workspace", reasons["sub/a.txt"])
        for dirpath, _dirs, names in os.walk(os.path.join(self.store, "payload")):
            for name in names:
                with open(os.path.join(dirpath, name), "rb") as fh:
                    self.assertNotIn(b"OUTSIDE SECRET", fh.read())

    @unittest.skipUnless(can_symlink(), "needs the right to make symlinks")
    def test_a_folder_swapped_back_and_forth_during_scans_never_lets_outside_in(self):
        # A real race: another thread keeps swapping sub/ (a folder with a
        # folder in it) for a link to an outside folder of the same shape
        # while saves and captures scan.
        self.outside = os.path.join(self.tmp, "outside")
        for n in range(12):
            write(self.outside, "f%02d.txt" % n, "OUTSIDE %d\n" % n)
            write(self.outside, "deep/g%02d.txt" % n, "OUTSIDE deep %d\n" % n)
            self.write("sub/f%02d.txt" % n, "inside %d\n" % n)
            self.write("sub/deep/g%02d.txt" % n, "inside deep %d\n" % n)
        cp = tc.Checkpoints(tc.Config(watch=False, git=False))
        cp.init(self.root, "race")
        stop = threading.Event()
        sub, moved = os.path.join(self.root, "sub"), os.path.join(self.root, "sub.moved")

        def swapper():
            while not stop.is_set():
                os.rename(sub, moved)
                os.symlink(self.outside, sub, target_is_directory=True)
                time.sleep(0.0005)
                os.remove(sub)
                os.rename(moved, sub)
                time.sleep(0.0005)

        thread = threading.Thread(target=swapper)
        thread.start()
        try:
            deadline = time.monotonic() + 2.0
            count = 0
            while time.monotonic() < deadline:
                self.write("top.txt", "round %d\n" % count)  # something to record each time
                if count % 2:
                    cp.capture(self.root)
                else:
                    cp.save(self.root, "round %d" % count)
                count += 1
        finally:
            stop.set()
            thread.join()
        for dirpath, _dirs, names in os.walk(os.path.join(self.store, "payload")):
            for name in names:
                with open(os.path.join(dirpath, name), "rb") as fh:
                    self.assertNotIn(b"OUTSIDE", fh.read(), "after %d scans" % count)

    def swap_sub(self):
        """Replace sub/ by a link to the outside folder."""
        os.rename(os.path.join(self.root, "sub"), os.path.join(self.root, "sub.moved"))
        os.symlink(self.outside, os.path.join(self.root, "sub"), target_is_directory=True)

    def after_scan(self, change):
        """Run change once, right after the next real scan of the workspace."""
        real_scan = tc.scan_tree
        done = []

        def scan_then_change(root, policy, dirs=None):
            result = real_scan(root, policy, dirs)
            if root == self.root and not done:
                done.append(True)
                change()
            return result

        tc.scan_tree = scan_then_change
        self.addCleanup(setattr, tc, "scan_tree", real_scan)

    def swap_before(self, owner, name):
        """Replace sub/ by a link to the outside folder right before the first
        call of owner.name: after every check the plan made of the paths."""
        real = getattr(owner, name)
        done = []

        def swapped(*args, **kwargs):
            if not done:
                done.append(True)
                self.swap_sub()
            return real(*args, **kwargs)

        setattr(owner, name, swapped)
        self.addCleanup(setattr, owner, name, real)

    def outside_folder(self):
        self.outside = os.path.join(self.tmp, "outside")
        os.makedirs(self.outside)
        for name in ("victim.txt", "gone.txt"):
            with open(os.path.join(self.outside, name), "w") as fh:
                fh.write("OUTSIDE %s\n" % name)
        return self.outside_files()

    def outside_files(self):
        return {name: None if os.path.isdir(os.path.join(self.outside, name))
                else read(self.outside, name) for name in sorted(os.listdir(self.outside))}

    def restore_case(self):
        before = self.outside_folder()
        self.write("sub/victim.txt", "v1\n")
        self.write("sub/new.txt", "n1\n")
        cp = tc.Checkpoints(tc.Config(watch=False, git=False))
        cp.init(self.root, "swap")
        cp.save(self.root, "one")
        self.write("sub/victim.txt", "v2\n")
        os.remove(os.path.join(self.root, "sub", "new.txt"))
        self.write("sub/gone.txt", "g\n")
        return cp, before

    @unittest.skipUnless(can_symlink(), "needs the right to make symlinks")
    def test_a_restore_does_not_delete_where_a_swapped_folder_points(self):
        cp, before = self.restore_case()
        self.swap_before(tc, "remove_within")
        with self.assertRaises(tc.CheckpointError) as caught:
            cp.restore(self.root, index=1, apply=True)
        self.assertIn("outside the workspace", str(caught.exception))
        self.assertEqual(self.outside_files(), before)

    @unittest.skipUnless(can_symlink(), "needs the right to make symlinks")
    def test_a_restore_does_not_write_where_a_swapped_folder_points(self):
        cp, before = self.restore_case()
        os.remove(os.path.join(self.root, "sub", "gone.txt"))  # nothing to delete first
        self.swap_before(tc.PayloadStore, "write_over")
        with self.assertRaises(tc.CheckpointError) as caught:
            cp.restore(self.root, index=1, apply=True)
        self.assertIn("outside the workspace", str(caught.exception))
        self.assertEqual(self.outside_files(), before)

    @unittest.skipUnless(can_symlink(), "needs the right to make symlinks")
    def test_a_restore_does_not_make_folders_where_a_swapped_folder_points(self):
        before = self.outside_folder()
        self.write("sub/deep/new.txt", "n1\n")
        cp = tc.Checkpoints(tc.Config(watch=False, git=False))
        cp.init(self.root, "swap")
        cp.save(self.root, "one")
        shutil.rmtree(os.path.join(self.root, "sub", "deep"))
        self.swap_before(tc, "make_dirs_within")
        with self.assertRaises(tc.CheckpointError) as caught:
            cp.restore(self.root, index=1, apply=True)
        self.assertIn("outside the workspace", str(caught.exception))
        self.assertEqual(self.outside_files(), before)
        self.assertFalse(os.path.lexists(os.path.join(self.outside, "deep")))

    @unittest.skipUnless(can_symlink(), "needs the right to make symlinks")
    def test_a_restore_does_not_prune_folders_where_a_swapped_folder_points(self):
        before = self.outside_folder()
        os.mkdir(os.path.join(self.outside, "deep"))  # empty, as the pruned one will be
        self.write("sub/kept.txt", "k\n")
        logged = []
        cp = tc.Checkpoints(tc.Config(watch=False, git=False), log=logged.append)
        cp.init(self.root, "swap")
        cp.save(self.root, "one")
        self.write("sub/deep/added.txt", "unsaved\n")
        self.swap_before(tc, "rmdir_within")  # the file is gone, its folder not yet
        with self.assertRaises(tc.CheckpointError) as caught:
            cp.restore(self.root, index=1, apply=True)
        self.assertIn("outside the workspace", str(caught.exception))
        self.assertTrue(os.path.isdir(os.path.join(self.outside, "deep")))
        self.assertEqual(self.outside_files(), dict(before, deep=None))
        # The deleted file cannot go back through the link; its content
        # stays in the store, and the log says where.
        log = "\n".join(logged)
        self.assertIn("'sub/deep/added.txt' was not put back", log)
        kept = log.split("its content stays in the store as ", 1)[1].split()[0]
        with open(kept, "rb") as fh:
            self.assertEqual(fh.read(), b"unsaved\n")

    @unittest.skipUnless(can_symlink(), "needs the right to make symlinks")
    def test_an_import_does_not_write_where_a_swapped_folder_points(self):
        before = self.outside_folder()
        self.write("sub/victim.txt", "from the package\n")
        self.write("sub/new.txt", "new\n")
        cp = tc.Checkpoints(tc.Config(watch=False, git=False))
        cp.init(self.root, "swap")
        cp.save(self.root, "one")
        out = os.path.join(self.tmp, "out")
        os.makedirs(out)
        package = cp.export(self.root, out)["path"]
        fresh = os.path.join(self.tmp, "fresh")
        write(fresh, "sub/victim.txt", "mine\n")
        self.root = fresh
        self.swap_before(tc.PayloadStore, "place_stored")
        with self.assertRaises(tc.CheckpointError) as caught:
            cp.import_package(fresh, package)
        self.assertIn("outside the workspace", str(caught.exception))
        self.assertEqual(self.outside_files(), before)

    @unittest.skipUnless(can_symlink(), "needs the right to make symlinks")
    def test_a_restore_cut_short_is_undone_after_its_folder_moved_behind_a_link(self):
        names = ["sub/f%02d.txt" % n for n in range(20)]
        for name in names:
            self.write(name, "old\n")
        cp = tc.Checkpoints(tc.Config(watch=False, git=False))
        cp.init(self.root, "moved")
        cp.save(self.root, "one")
        for name in names:
            self.write(name, "unsaved work\n")
        # The restore dies after 10 files, its journal left for the next
        # server (what a kill leaves; here the rollback is kept from running).
        real_write, real_undo = tc.PayloadStore.write_over, tc.Checkpoints._undo
        calls = []

        def dying_write(*args, **kwargs):
            calls.append(1)
            if len(calls) > 10:
                raise OSError(5, "the server died here")
            return real_write(*args, **kwargs)

        def no_rollback(cp_, journal, what, exc):
            raise exc

        tc.PayloadStore.write_over, tc.Checkpoints._undo = dying_write, no_rollback
        try:
            with self.assertRaises(OSError):
                cp.restore(self.root, index=1, apply=True)
        finally:
            tc.PayloadStore.write_over, tc.Checkpoints._undo = real_write, real_undo
        moved = os.path.join(self.tmp, "elsewhere", "ws")
        os.makedirs(os.path.dirname(moved))
        os.rename(self.root, moved)
        os.symlink(moved, self.root, target_is_directory=True)
        later = tc.Checkpoints(tc.Config(watch=False, git=False))
        # The task is known by its old path; any call that takes the store's
        # lock finishes the rollback first, a new task's init among them.
        later.init(self.root, "again")
        self.assertEqual({name: read(moved, name) for name in names},
                         {name: b"unsaved work\n" for name in names})

    def test_a_file_an_editor_replaced_after_the_scan_is_still_read(self):
        self.write("sub/a.txt", "one\n")
        cp = tc.Checkpoints(tc.Config(watch=False, git=False))
        cp.init(self.root, "replaced")
        cp.save(self.root, "one")
        self.write("sub/a.txt", "two\n")

        def replace():  # a new inode under the same name, as editors save
            self.write("sub/a.txt.new", "three\n")
            os.replace(os.path.join(self.root, "sub", "a.txt.new"),
                       os.path.join(self.root, "sub", "a.txt"))

        self.after_scan(replace)
        saved = cp.save(self.root, "two")
        self.assertEqual(saved["skipped_paths"], [])
        self.write("sub/a.txt", "four\n")
        cp.restore(self.root, index=2, apply=True)
        self.assertEqual(self.read("sub/a.txt"), b"three\n")


class ReadOnlyWorkspaceTests(WorkspaceTest):

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


class StoreTests(WorkspaceTest):

    def test_a_project_that_merely_resembles_a_store_is_a_workspace(self):
        # A tasks/ folder and a state.lock file are ordinary project content.
        self.write("tasks/build.py", "print('build')\n")
        self.write("state.lock", "")
        srv = self.server()
        srv.ok("tc_init", root=self.root, name="lookalike")
        self.assertEqual(srv.ok("tc_save", root=self.root, title="one")["index"], 1)

    def test_a_damaged_record_is_named_not_an_internal_error(self):
        self.write("a.txt", "one\n")
        srv = self.server()
        task_id = srv.ok("tc_init", root=self.root, name="damaged")["task_id"]
        srv.ok("tc_save", root=self.root, title="one")
        self.write("a.txt", "two\n")
        srv.ok("tc_capture", root=self.root)
        srv.ok("tc_save", root=self.root, title="two")
        srv.close()
        task = os.path.join(self.store, "tasks", task_id)

        def edit(rel, change):
            path = os.path.join(self.store, rel)
            with open(path, "rb") as fh:
                doc = json.loads(fh.read())
            with open(path, "w", encoding="utf-8") as fh:
                json.dump(change(doc), fh)

        def manifest_of_step_one(doc):
            table = doc.get("files") or doc.get("changes")
            table[sorted(table)[0]] = ["f", "../../../outside", 4, 420, 0]
            return doc

        step_one = json.loads(read(task, "steps/s0001.json"))
        step_two = json.loads(read(task, "steps/s0002.json"))
        out = os.path.join(self.tmp, "out")
        os.makedirs(out)

        def escaping_path(doc):
            table = doc.get("files") or doc.get("changes")
            table["../../escaped.txt"] = table[sorted(table)[0]] or ["f", "ab" * 32, 1, 420, 0]
            return doc

        cases = [
            ("state.json", lambda d: dict(d, head="two"), "tc_show", {}),
            ("steps/s0002.json", lambda d: [], "tc_show", {"index": 2}),
            ("manifest/m%04d.json" % step_one["manifest"], manifest_of_step_one,
             "tc_restore", {"index": 1}),
            ("drifts/d0002.json", lambda d: dict(d, created_ns=None), "tc_compress",
             {"keep_seconds": 0}),
            ("../../current.json", lambda d: {"format": 1, "active": 42}, "tc_resume", {}),
            ("manifest/m%04d.json" % step_two["manifest"], escaping_path, "tc_export",
             {"to": out}),
        ]
        for rel, change, tool, args in cases:
            with self.subTest(record=rel):
                path = os.path.join(task, rel)
                with open(path, "rb") as fh:
                    good = fh.read()
                edit(os.path.relpath(path, self.store), change)
                srv = self.server()
                res = srv.call(tool, root=self.root, **args)
                self.assertTrue(res.is_error, res)
                self.assertIn(os.path.basename(rel), res.text)
                self.assertNotIn("internal error", res.text)
                with open(path, "wb") as fh:
                    fh.write(good)
                for folder in (self.tmp, out):
                    self.assertFalse(os.path.exists(os.path.join(folder, "escaped.txt")))
                self.assertFalse(srv.call(tool, root=self.root, **args).is_error)
                for name in os.listdir(out):
                    shutil.rmtree(os.path.join(out, name))
                srv.close()
        # The index is only a cache: a damaged row means reading files again.
        rows = json.loads(read(task, "index.json"))
        rows["files"]["b.txt"] = rows["files"]["a.txt"][:7] + ["../a"]
        with open(os.path.join(task, "index.json"), "w", encoding="utf-8") as fh:
            json.dump(rows, fh)
        srv = self.server()
        health = srv.ok("tc_resume", root=self.root)["health"]
        self.assertIn("index", " ".join(health["errors"]))
        self.assertEqual(srv.ok("tc_save", root=self.root, title="three")["index"], 3)
        self.assertTrue(srv.ok("tc_resume", root=self.root)["health"]["ok"])

    def test_json_nested_past_the_parser_is_damage_not_an_internal_error(self):
        nested = "[" * 50000 + "]" * 50000
        self.write("a.txt", "one\n")
        srv = self.server()
        task_id = srv.ok("tc_init", root=self.root, name="nested")["task_id"]
        srv.ok("tc_save", root=self.root, title="one")
        out = os.path.join(self.tmp, "out")
        os.makedirs(out)
        package = srv.ok("tc_export", root=self.root, to=out)["path"]
        with open(os.path.join(package, "handoff.json"), "w", encoding="utf-8") as fh:
            fh.write(nested)
        fresh = os.path.join(self.tmp, "fresh")
        write(fresh, "b.txt", "b\n")
        res = srv.call("tc_import", root=fresh, package=package)
        self.assertTrue(res.is_error, res)
        self.assertIn("handoff.json", res.text)
        self.assertIn("nested too deeply", res.text)

        state = os.path.join(self.store, "tasks", task_id, "state.json")
        with open(state, "rb") as fh:
            good = fh.read()
        with open(state, "w", encoding="utf-8") as fh:
            fh.write('{"head": %s}' % nested)
        res = srv.call("tc_show", root=self.root)
        self.assertTrue(res.is_error, res)
        self.assertIn("state.json", res.text)
        with open(state, "wb") as fh:
            fh.write(good)

        # Workspace content alone: a repository can carry any pointer file.
        other = os.path.join(self.tmp, "cloned")
        write(other, tc.POINTER_NAME, '{"store": %s}' % nested)
        for tool, args in (("tc_resume", {}), ("tc_init", {"name": "x"})):
            res = srv.call(tool, root=other, **args)
            self.assertTrue(res.is_error, res)
            self.assertIn("store pointer", res.text)
        srv.ok("tc_show", root=self.root)

    def test_an_export_into_a_store_is_refused(self):
        self.write("a.txt", "one\n")
        srv = self.server()
        task_id = srv.ok("tc_init", root=self.root, name="exported")["task_id"]
        srv.ok("tc_save", root=self.root, title="one")
        external = os.path.join(self.tmp, "shared-store")
        other = os.path.join(self.tmp, "other")
        write(other, "b.txt", "b\n")
        srv.ok("tc_init", root=other, name="elsewhere", store=external)
        for to in (self.store, os.path.join(self.store, "tasks"),
                   os.path.join(self.store, "payload"), external,
                   os.path.join(external, "tasks")):
            with self.subTest(to=to):
                res = srv.call("tc_export", root=self.root, to=to)
                self.assertTrue(res.is_error, res)
                self.assertIn("inside the checkpoint store", res.text)
                self.assertFalse(os.path.exists(os.path.join(to, task_id + "-handoff")))
        out = os.path.join(self.tmp, "out")
        os.makedirs(out)
        self.assertTrue(srv.ok("tc_export", root=self.root, to=out)["path"].startswith(out))

    def test_kernel_pseudo_file_systems_are_refused_as_workspaces(self):
        srv = self.server()
        for root in ("/proc", "/sys", "/dev"):
            if not os.path.isdir(root) or tc.file_system_type(root) not in \
                    tc.PSEUDO_FILE_SYSTEMS:
                continue
            with self.subTest(root=root):
                existed = os.path.exists(os.path.join(root, ".checkpoints"))
                res = srv.call("tc_init", root=root, name="kernel")
                self.assertTrue(res.is_error, res)
                self.assertIn("file system", res.text)
                self.assertEqual(os.path.exists(os.path.join(root, ".checkpoints")), existed)

    def test_a_store_is_refused_as_a_workspace(self):
        srv = self.server()
        srv.ok("tc_init", root=self.root, name="outer")
        res = srv.call("tc_init", root=self.store, name="inner")
        self.assertTrue(res.is_error, res)
        self.assertIn("inside the checkpoint store", res.text)

    def test_compress_keeps_content_another_workspace_still_needs(self):
        store = os.path.join(self.tmp, "shared")
        other = os.path.join(self.tmp, "other")
        os.makedirs(other)
        srv = self.server(env={"TC_STORE": store})
        write(other, "f.txt", "base\n")
        srv.ok("tc_init", root=other, name="b")
        write(other, "f.txt", "shared content\n")
        kept = srv.ok("tc_capture", root=other)["drift_id"]
        write(other, "f.txt", "later\n")
        srv.ok("tc_capture", root=other)
        self.write("g.txt", "a0\n")
        srv.ok("tc_init", root=self.root, name="a")
        self.write("g.txt", "shared content\n")
        srv.ok("tc_capture", root=self.root)
        self.write("g.txt", "a2\n")
        srv.ok("tc_capture", root=self.root)
        srv.ok("tc_compress", root=self.root, keep_seconds=0, minimum=0)
        res = srv.call("tc_restore", root=other, drift_id=kept)
        if res.is_error:  # refused as reclaimed is honest too
            self.assertIn("reclaimed", res.text)
            return
        self.assertEqual(res["plan"]["unrestorable"], [],
                         "compress on one workspace destroyed another's drift content")

    def test_half_created_task_does_not_break_compress(self):
        srv = self.server()
        self.write("a.txt", "1\n")
        srv.ok("tc_init", root=self.root, name="t")
        os.makedirs(os.path.join(self.store, "tasks", "half-abc123", "drifts"))
        res = srv.call("tc_compress", root=self.root)
        self.assertFalse(res.is_error, res.text)

    def test_default_store_init_after_external_store(self):
        srv = self.server()
        self.write("a.txt", "1\n")
        ext = os.path.join(self.tmp, "ext")
        one = srv.ok("tc_init", root=self.root, name="one", store=ext)["task_id"]
        # The workspace names one store: a task elsewhere would leave "one"
        # out of reach, so that is refused, naming it.
        res = srv.call("tc_init", root=self.root, name="two", store=self.store)
        self.assertTrue(res.is_error, res)
        self.assertIn(one, res.text)
        self.assertIn(ext, res.text)
        self.assertFalse(os.path.exists(self.store))
        self.assertEqual(srv.ok("tc_save", root=self.root, title="step")["task_id"], one)
        # With that store moved aside, the default store takes the workspace.
        shutil.move(ext, ext + "-old")
        two = srv.ok("tc_init", root=self.root, name="two", store=self.store)
        saved = srv.ok("tc_save", root=self.root, title="step")
        self.assertEqual(saved["task_id"], two["task_id"])

    def test_store_argument_wins_or_is_refused_when_tc_store_is_set(self):
        srv = self.server(env={"TC_STORE": os.path.join(self.tmp, "env-store")})
        self.write("a.txt", "1\n")
        res = srv.call("tc_init", root=self.root, name="x",
                       store=os.path.join(self.tmp, "arg-store"))
        if res.is_error:
            return
        saved = srv.call("tc_save", root=self.root, title="step")
        self.assertFalse(saved.is_error, saved.text)
        self.assertEqual(saved["task_id"], res["task_id"])

    def test_pointer_to_the_workspace_root_is_refused(self):
        self.write("a.txt", "1\n")
        with open(os.path.join(self.root, ".task-checkpoint-store.json"), "w") as fh:
            json.dump({"store": self.root}, fh)
        srv = self.server()
        res = srv.call("tc_init", root=self.root, name="t")
        self.assertTrue(res.is_error, res.text)
        self.assertFalse(os.path.exists(os.path.join(self.root, "tasks")))

    def test_store_argument_never_deletes_files_already_there(self):
        notes = os.path.join(self.tmp, "notes")
        write(notes, "writing", "my novel, chapter 1\n")
        write(notes, "drafts/.tmp-idea.txt", "an idea\n")
        self.write("a.txt", "1\n")
        srv = self.server()
        srv.call("tc_init", root=self.root, name="t", store=notes)
        for rel, data in (("writing", b"my novel, chapter 1\n"),
                          ("drafts/.tmp-idea.txt", b"an idea\n")):
            self.assertTrue(os.path.isfile(os.path.join(notes, *rel.split("/"))),
                            "tc_init deleted %s from the directory given as store" % rel)
            self.assertEqual(read(notes, rel), data)


class WatcherAndGitTests(WorkspaceTest):

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

    def test_closing_save_that_makes_a_step_gets_its_ref(self):
        make_git_repo(self.root)
        srv = self.server(env={"TC_GIT": "on"})
        task = srv.ok("tc_init", root=self.root, name="t")["task_id"]
        self.write("a.txt", "1\n")
        srv.ok("tc_save", root=self.root, title="one")
        self.write("a.txt", "2\n")
        closed = srv.ok("tc_save", root=self.root, title="final", close=True)
        self.assertFalse(closed["idempotent"])
        ref = "refs/checkpoints/%s/s%04d" % (task, closed["index"])
        self.assertEqual(closed["git"]["ref"], ref, closed["git"])
        self.assertIn(ref.encode(), git(self.root, "for-each-ref", "refs/checkpoints/"))


@unittest.skipUnless(hasattr(os, "mkfifo"), "needs os.mkfifo")
@unittest.skipUnless(can_symlink(), "needs the right to make symlinks")
class SwappedFileTests(WorkspaceTest):
    """A file replaced between the scan and the read: by a FIFO (an open
    would wait for a writer forever) or by a symlink to a file elsewhere
    (its bytes would be stored as the workspace's)."""

    def setUp(self):
        super().setUp()
        self.secret = os.path.join(self.tmp, "elsewhere.txt")
        with open(self.secret, "wb") as fh:
            fh.write(b"bytes from outside the workspace " + os.urandom(8).hex().encode())
        self.fifo = os.path.join(self.root, "pipe")
        os.mkfifo(self.fifo)
        self.link = os.path.join(self.root, "link.txt")
        os.symlink(self.secret, self.link)

    def in_time(self, fn, *args):
        """fn(*args) in a thread; fails the test if it is still running after 5 s."""
        outcome = {}

        def run():
            try:
                outcome["value"] = fn(*args)
            except BaseException as exc:  # handed to the test thread
                outcome["error"] = exc
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(5)
        if thread.is_alive():
            with open(self.fifo, "wb"):  # let the blocked open go, then fail
                pass
            self.fail("%s(%r) blocked" % (fn.__name__, args))
        return outcome

    def test_reads_refuse_what_is_not_a_regular_file(self):
        payloads = tc.PayloadStore(os.path.join(self.tmp, "payload"))
        for path, words in ((self.fifo, "not a regular file"), (self.link, "symlink")):
            for fn in (payloads.put_file, tc.hash_file):
                outcome = self.in_time(fn, path)
                self.assertIsInstance(outcome.get("error"), OSError, (fn.__name__, outcome))
                self.assertIn(words, str(outcome["error"]))
        self.assertEqual(os.listdir(payloads.directory) if os.path.isdir(payloads.directory)
                         else [], [], "something was stored")
        outcome = self.in_time(tc.read_json, self.fifo)
        self.assertIsInstance(outcome.get("error"), tc.StoreCorrupt, outcome)

    def test_save_with_files_swapped_under_it_neither_blocks_nor_stores_outside_bytes(self):
        os.remove(self.fifo)
        os.remove(self.link)
        for i in range(40):
            self.write("f%02d.txt" % i, "file %d\n" % i)
        srv = self.server(env={"TC_WATCH": "off"})
        srv.ok("tc_init", root=self.root, name="swapped")
        target = os.path.join(self.root, "flip.txt")
        stop = threading.Event()

        def flip():
            turn = 0
            while not stop.is_set():
                turn += 1
                tmp = os.path.join(self.root, ".flip")
                try:
                    if turn % 3 == 0:
                        with open(tmp, "wb") as fh:
                            fh.write(b"regular %d\n" % turn)
                    elif turn % 3 == 1:
                        os.symlink(self.secret, tmp)
                    else:
                        os.mkfifo(tmp)
                    os.replace(tmp, target)
                except OSError:
                    pass
        flipper = threading.Thread(target=flip)
        flipper.start()
        try:
            for i in range(60):
                name, args = (("tc_save", {"title": "s%d" % i}) if i % 2
                              else ("tc_capture", {}))
                srv._id += 1
                srv.send_raw((json.dumps({"jsonrpc": "2.0", "id": srv._id,
                                          "method": "tools/call",
                                          "params": {"name": name, "arguments": dict(
                                              root=self.root, **args)}}) + "\n").encode())
                ready, _, _ = select.select([srv.proc.stdout], [], [], 10)
                self.assertTrue(ready, "%s %d never answered" % (name, i))
                reply = json.loads(srv.proc.stdout.readline())
                self.assertNotIn("error", reply)
        finally:
            stop.set()
            flipper.join()
            if os.path.exists(target):
                os.remove(target)
        with open(self.secret, "rb") as fh:
            self.assertFalse(store_holds(self.store, fh.read()),
                             "a file outside the workspace was stored through a symlink")


if __name__ == "__main__":
    unittest.main()
