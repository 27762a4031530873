"""Other programs writing files while an operation runs.

A save reads files that an editor, a formatter or the agent's own shell may
be rewriting, replacing, or swapping for a link or a FIFO at that moment; a
restore or an import writes files that they may write too. A step holds only
states a file really had; nothing from outside the workspace comes in
through a link, nor is written or deleted through one; no read waits on a
FIFO. A file written after a restore's or an import's journal reached the
disk keeps the other program's bytes: it is left as it is, reported in
skipped_paths, and read by the next scan. Where the moment matters the other
program is a hook on the real code path (right after the journal is written,
after the scan, before a write), so it is always the same; elsewhere a
thread races the real code.
"""

import json
import os
import select
import shutil
import sys
import threading
import time
import unittest

import support
from support import EditedMeanwhileTest, WorkspaceTest, can_symlink, read, sha, store_holds, write

sys.path.insert(0, support.SCRIPTS)
import tc  # noqa: E402


class EditsWhileWriting(EditedMeanwhileTest):

    def test_a_restore_leaves_each_file_written_meanwhile_as_it_is(self):
        self.two_steps()
        self.write("replaced.txt", "unsaved edit before the restore\n")
        meanwhile = {"replaced.txt": b"written while the restore ran\n",
                     "deleted.txt": b"also written while the restore ran\n",
                     "written.txt": b"made while the restore ran\n"}
        self.edit_once_the_journal_is_written(meanwhile)
        res = self.cp.restore(self.root, index=1, apply=True)
        for rel, data in meanwhile.items():
            self.assertEqual(self.read(rel), data, rel)
        self.assertEqual(self.read("plain.txt"), b"plain 1\n")  # the rest is restored
        left = {item["path"]: item["reason"] for item in res["skipped_paths"]}
        self.assertEqual(sorted(left), sorted(meanwhile))
        self.assertIn("changed by something else while the restore ran", left["replaced.txt"])
        # The edit before the restore is in the recovered record, as ever.
        undo = self.cp.restore(self.root, drift_id=res["recovered"], apply=True)
        self.assertEqual(self.read("replaced.txt"), b"unsaved edit before the restore\n")
        # And what was written meanwhile is in the store: undoing the undo brings it back.
        self.cp.restore(self.root, drift_id=undo["recovered"], apply=True)
        self.assertEqual(self.read("replaced.txt"), meanwhile["replaced.txt"])

    def test_a_file_written_meanwhile_beside_an_unrestorable_one(self):
        # The files left as they are and those the plan could never restore
        # (a sensitive one here) are reported side by side.
        self.two_steps()
        self.write(".env", "TOKEN=changed since step 1\n")
        self.edit_once_the_journal_is_written({"replaced.txt": b"meanwhile\n"})
        res = self.cp.restore(self.root, index=1, apply=True)
        self.assertEqual([item["path"] for item in res["skipped_paths"]], ["replaced.txt"])
        self.assertIn(".env", [item["path"] for item in res["plan"]["unrestorable"]])
        self.assertEqual(self.read("replaced.txt"), b"meanwhile\n")
        self.assertEqual(self.read("plain.txt"), b"plain 1\n")

    def test_the_next_save_records_what_was_written_meanwhile(self):
        self.two_steps()
        self.edit_once_the_journal_is_written({"replaced.txt": b"meanwhile\n"})
        self.cp.restore(self.root, index=1, apply=True)
        index = self.cp.save(self.root, "three")["index"]
        files = self.step_files(index)
        self.assertEqual(files["replaced.txt"], sha(b"meanwhile\n"))
        self.assertEqual(files["plain.txt"], sha(b"plain 1\n"))

    def test_a_restores_own_work_on_hard_linked_names_is_not_taken_for_an_edit(self):
        # Removing or replacing one name of a file moves the ctime of its
        # other names: that is the restore's doing, not another program's.
        self.write("a.txt", "a at step 1\n")
        self.write("b.txt", "b at step 1\n")
        self.cp.init(self.root, "links")
        self.cp.save(self.root, "one")
        for rel in ("a.txt", "b.txt"):
            os.remove(os.path.join(self.root, rel))
        self.write("a.txt", "one file, three names, at step 2\n")
        for rel in ("b.txt", "c.txt"):
            os.link(os.path.join(self.root, "a.txt"), os.path.join(self.root, rel))
        self.cp.save(self.root, "two")
        res = self.cp.restore(self.root, index=1, apply=True)
        self.assertEqual(res["skipped_paths"], [])
        self.assertEqual(res["plan"]["to_delete"], ["c.txt"])
        self.assertEqual(self.read("a.txt"), b"a at step 1\n")
        self.assertEqual(self.read("b.txt"), b"b at step 1\n")
        self.assertFalse(os.path.exists(os.path.join(self.root, "c.txt")))

    def test_a_file_left_in_the_way_keeps_the_paths_it_blocks_out_too(self):
        # Step 1 has a folder x; now x is a file, which is written meanwhile:
        # x stays, so x/inside.txt cannot be written, and the rest goes on.
        self.folder_then_file("x/inside.txt", "a file now\n")
        self.edit_once_the_journal_is_written({"x": b"the file, written meanwhile\n"})
        res = self.cp.restore(self.root, index=1, apply=True)
        self.assertEqual(sorted(item["path"] for item in res["skipped_paths"]),
                         ["x", "x/inside.txt"])
        self.assertEqual(self.read("x"), b"the file, written meanwhile\n")
        self.assertEqual(self.read("plain.txt"), b"plain 1\n")

    def test_a_file_made_meanwhile_where_a_folder_must_go_is_left_with_it(self):
        self.folder_then_file("d/f.txt")
        self.edit_once_the_journal_is_written({"d": b"a file made meanwhile\n"})
        res = self.cp.restore(self.root, index=1, apply=True)
        self.assertEqual([item["path"] for item in res["skipped_paths"]], ["d/f.txt"])
        self.assertIn("stands where one of its folders must go", res["skipped_paths"][0]["reason"])
        self.assertEqual(self.read("d"), b"a file made meanwhile\n")
        self.assertEqual(self.read("plain.txt"), b"plain 1\n")

    def test_a_file_open_over_makes_passes_a_check_for_no_file(self):
        # Also where the workspace guard is off (Windows): open_over knows
        # whether it made the file, so "no file here" holds for one it made.
        dest = os.path.join(self.root, "new.txt")
        fh, _before = tc.open_over(dest, 0o644, expect=None)
        with fh:
            fh.write(b"new\n")
        self.assertEqual(self.read("new.txt"), b"new\n")
        gone = os.path.join(self.root, "gone.txt")
        with self.assertRaises(tc.ChangedMeanwhile):
            tc.open_over(gone, 0o644, expect=(4, 1))
        self.assertFalse(os.path.exists(gone), "the file made for the check stays")
        with self.assertRaises(tc.ChangedMeanwhile):
            tc.open_over(dest, 0o644, expect=None)
        self.assertEqual(self.read("new.txt"), b"new\n")

    def test_an_import_leaves_a_file_written_meanwhile_as_it_is(self):
        self.two_steps()
        out = os.path.join(self.tmp, "out")
        os.makedirs(out)
        package = self.cp.export(self.root, out)["path"]
        other = os.path.join(self.tmp, "other")
        os.makedirs(other)
        with open(os.path.join(other, "replaced.txt"), "wb") as fh:
            fh.write(b"here before the import\n")
        self.root, theirs = other, self.root
        self.edit_once_the_journal_is_written({"replaced.txt": b"written while it imported\n",
                                               "deleted.txt": b"made while it imported\n"})
        res = self.cp.import_package(other, package)
        self.assertEqual(self.read("replaced.txt"), b"written while it imported\n")
        self.assertEqual(self.read("deleted.txt"), b"made while it imported\n")
        self.assertEqual(self.read("plain.txt"), b"plain 2, longer\n")
        self.assertEqual(sorted(item["path"] for item in res["skipped_paths"]),
                         ["deleted.txt", "replaced.txt"])
        self.assertIsNone(res["recovered"])  # nothing here was overwritten
        resumed = self.cp.resume(other)
        self.assertEqual(sorted(resumed["drift_paths"]), ["deleted.txt", "replaced.txt"])
        self.root = theirs


class ChangingWhileReadTest(WorkspaceTest):
    """A file rewritten while a save reads it: each step must hold a state
    the file really had, never the first part of one version joined to the
    rest of the next."""

    server_env = {"TC_WATCH": "off"}
    SIZE = 4 << 20

    def test_a_step_never_holds_a_mix_of_two_versions(self):
        path = os.path.join(self.root, "big.bin")
        with open(path, "wb") as fh:
            fh.write(b"A" * self.SIZE)
        srv = self.server()
        srv.ok("tc_init", root=self.root, name="torn")
        stop = threading.Event()

        # Each version goes in with one write, so the file holds a mix only
        # while that write runs (a writer paused between several writes
        # would leave a mix that is, for that while, what the file holds).
        versions = [bytes([ord("B") + letter]) * self.SIZE for letter in range(20)]

        def rewrite():
            letter = 0
            fd = os.open(path, os.O_WRONLY)
            try:
                while not stop.is_set():
                    data, offset = versions[letter % 20], 0
                    while offset < self.SIZE:
                        offset += os.pwrite(fd, data[offset:], offset)
                    letter += 1
            finally:
                os.close(fd)

        writer = threading.Thread(target=rewrite)
        writer.start()
        try:
            steps = [srv.ok("tc_save", root=self.root, title="save %d" % number)["index"]
                     for number in range(8)]
        finally:
            stop.set()
            writer.join()
        for index in steps:
            srv.ok("tc_restore", root=self.root, index=index, apply=True)
            with open(path, "rb") as fh:
                data = fh.read()
            self.assertEqual(len(data), self.SIZE)
            self.assertEqual(data.count(data[:1]), self.SIZE,
                             "step %d holds a mix of versions: %r" % (index, sorted(set(data))))

    def test_a_file_appended_to_while_it_is_read_is_recorded(self):
        path = os.path.join(self.root, "train.log")
        with open(path, "wb") as fh:
            fh.write(b"warming up\n" * (self.SIZE // 11))
        srv = self.server()
        srv.ok("tc_init", root=self.root, name="log")
        stop = threading.Event()

        def append():
            number = 0
            with open(path, "ab", buffering=0) as fh:
                while not stop.is_set():
                    fh.write(b"epoch %d loss 0.%04d\n" % (number, number % 9973))
                    number += 1
                    stop.wait(0.001)

        writer = threading.Thread(target=append)
        writer.start()
        try:
            saves = [srv.ok("tc_save", root=self.root, title="save %d" % n) for n in range(4)]
        finally:
            stop.set()
            writer.join()
        with open(path, "rb") as fh:
            final = fh.read()
        for saved in saves:
            self.assertNotIn("train.log", [p["path"] for p in saved["skipped_paths"]], saved)
        for saved in saves:
            srv.ok("tc_restore", root=self.root, index=saved["index"], apply=True)
            with open(path, "rb") as fh:
                held = fh.read()
            self.assertGreaterEqual(len(held), self.SIZE // 11 * 11)
            self.assertTrue(final.startswith(held), "step %d is no state the log had"
                            % saved["index"])


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

        def scan_then_change(root, policy, dirs=None, **options):
            result = real_scan(root, policy, dirs, **options)
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
