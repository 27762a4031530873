"""The watcher's change events: an idle tick skips its walk only while the
kernel reports nothing, and no change is left unrecorded because of it.

The first tests run the real server with its default (events on, where the
platform has them); the others drive Watcher.tick with an explicit clock, so
the periodic walk can be reached without waiting for it.
"""

import os
import shutil
import subprocess
import sys
import textwrap
import unittest

from support import SCRIPTS, WorkspaceTest, drift_paths
from test_drift import WATCH_ON, all_drifts, wait_for

sys.path.insert(0, SCRIPTS)
import tc  # noqa: E402

EVENTS = tc.DirectoryEvents.open() is not None


def changes_since(srv, root, known):
    """{"added", "modified", "deleted"} -> paths over the drifts not in known."""
    out = {kind: set() for kind in ("added", "modified", "deleted")}
    for record in all_drifts(srv, root):
        if record["id"] not in known:
            for kind in out:
                out[kind].update(drift_paths(record, kind))
    return out


class ServerWatcherEvents(WorkspaceTest):
    """Through the real server: what the watcher records with events on."""

    def start(self, env=WATCH_ON):
        self.write("src/app.py", "print(1)\n")
        self.write("docs/guide.md", "# guide\n")
        srv = self.server(env=env)
        srv.ok("tc_init", root=self.root, name="events")
        srv.ok("tc_save", root=self.root, title="start", conclusion="c", next="n")
        return srv

    def start_settled(self):
        """A started task after a few idle ticks (the watches are in place),
        with the drift records it already has."""
        srv = self.start()
        wait_for(lambda: False, 0.8)
        return srv, self.known(srv)

    def recorded(self, srv, known, kind, rel, timeout=10):
        return wait_for(lambda: rel in changes_since(srv, self.root, known)[kind], timeout)

    def known(self, srv):
        return {d["id"] for d in all_drifts(srv, self.root)}

    def test_files_in_directories_made_after_the_start_are_recorded(self):
        srv, known = self.start_settled()
        os.makedirs(os.path.join(self.root, "new", "deeper", "still"))
        self.write("new/deeper/still/made.txt", "made later\n")
        self.assertTrue(self.recorded(srv, known, "added", "new/deeper/still/made.txt"),
                        "a file in a new nested directory was not recorded")
        known = self.known(srv)
        self.write("new/deeper/still/made.txt", "edited in the new directory\n")
        self.assertTrue(self.recorded(srv, known, "modified", "new/deeper/still/made.txt"),
                        "an edit inside a directory watched since the start was missed")

    def test_same_size_edit_with_its_mtime_put_back_is_recorded_while_idle(self):
        srv, known = self.start_settled()
        path = os.path.join(self.root, "src", "app.py")
        before = os.stat(path)
        with open(path, "wb") as fh:
            fh.write(b"print(2)\n")
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
        self.assertTrue(self.recorded(srv, known, "modified", "src/app.py"),
                        "a same-size edit with the old mtime was missed by the watcher")

    def test_edits_in_a_renamed_directory_are_recorded(self):
        srv, known = self.start_settled()
        os.rename(os.path.join(self.root, "docs"), os.path.join(self.root, "manual"))
        self.assertTrue(self.recorded(srv, known, "added", "manual/guide.md"))
        known = self.known(srv)
        self.write("manual/guide.md", "# the guide, rewritten\n")
        self.assertTrue(self.recorded(srv, known, "modified", "manual/guide.md"),
                        "an edit in a renamed directory was missed")

    def test_polling_only_still_records(self):
        env = dict(WATCH_ON, TC_WATCH_EVENTS="off")
        srv = self.start(env)
        known = self.known(srv)
        self.write("src/app.py", "print('polled')\n")
        self.assertTrue(self.recorded(srv, known, "modified", "src/app.py"))


@unittest.skipUnless(EVENTS, "no inotify on this platform")
class TickWithEvents(WorkspaceTest):
    """Watcher.tick with its own clock: when a tick walks and when it does not."""

    def setUp(self):
        super().setUp()
        self.write("a/b/file.txt", "one\n")
        self.write("top.txt", "top\n")
        self.cp = tc.Checkpoints(tc.Config(watch=True, watch_interval=3600,
                                           drift_max_wait=60, git=False))
        self.cp.init(self.root, "t")
        self.cp.start_watcher()
        self.addCleanup(self.cp.stop_watcher)
        self.watcher = self.cp.watcher
        self.now = 1000.0
        self.assertEqual(self.tick(), "idle")  # walks, then watches every directory
        self.assertEqual(self.tick(), "idle")  # walks once more for what the watches missed
        self.assertFalse(self.needs_walk(), "a settled root still asks for a walk")

    def tick(self, seconds=1.0):
        self.now += seconds
        return self.watcher.tick(self.root, now=self.now)

    def needs_walk(self):
        return self.watcher.events.needs_walk(self.root, self.now)

    def settle(self):
        """Tick until the watcher has recorded what it saw; the actions taken."""
        actions = [self.tick()]
        while actions[-1] == "wait" and len(actions) < 5:
            actions.append(self.tick())
        return actions

    def test_an_unreported_change_waits_for_the_periodic_walk(self):
        # A write through a hard link from outside the workspace reaches the
        # file's inode but none of the workspace's directory watches.
        outside = os.path.join(self.tmp, "outside-link")
        os.link(os.path.join(self.root, "top.txt"), outside)
        with open(outside, "r+b") as fh:
            fh.write(b"TOP\n")
        self.assertEqual(self.tick(), "idle", "an idle tick walked without any event")
        self.assertEqual(self.tick(tc.WATCH_FULL_SCAN_SECONDS), "wait",
                         "the periodic walk did not find the unreported change")
        self.assertEqual(self.settle(), ["capture"])
        drift = self.cp.show(self.root, include_drift=True)["drifts"][-1]
        self.assertEqual(set(drift_paths(drift, "modified")), {"top.txt"})

    def test_store_writes_and_excluded_names_do_not_wake_the_watcher(self):
        self.cp.save(self.root, "a step", conclusion="c", next="n")
        self.cp.capture(self.root)
        self.assertEqual(self.tick(), "idle")  # the index changed: one walk
        self.assertFalse(self.needs_walk(), "the store's own writes woke the watcher")
        os.makedirs(os.path.join(self.root, "node_modules", "pkg"))
        self.write("node_modules/pkg/index.js", "x\n")
        self.write("old.bak", "excluded by name\n")
        self.assertFalse(self.needs_walk(), "changes to excluded names woke the watcher")
        self.write("a/b/file.txt", "two\n")
        self.assertTrue(self.needs_walk(), "an edit in a watched directory went unnoticed")
        self.assertEqual(self.settle(), ["wait", "capture"])

    def test_a_directory_put_in_place_of_a_watched_one_is_watched(self):
        os.rename(os.path.join(self.root, "a"), os.path.join(self.root, "a.old"))
        self.write("a/b/file.txt", "a new directory under the old name\n")
        self.assertEqual(self.settle(), ["wait", "capture"])
        self.assertEqual(self.tick(), "idle")
        self.write("a/b/file.txt", "edited in the new directory\n")
        self.assertTrue(self.needs_walk(), "the new a/b is not watched")
        self.assertEqual(self.settle(), ["wait", "capture"])

    def test_a_directory_deleted_while_held_open_and_made_again_is_watched(self):
        held = os.open(os.path.join(self.root, "a", "b"), os.O_RDONLY)
        try:
            os.remove(os.path.join(self.root, "a", "b", "file.txt"))
            os.rmdir(os.path.join(self.root, "a", "b"))
            self.write("a/b/file.txt", "made again\n")
            self.assertEqual(self.settle(), ["wait", "capture"])
            self.assertEqual(self.tick(), "idle")
            self.write("a/b/file.txt", "edited again\n")
            self.assertTrue(self.needs_walk(), "the re-made a/b is not watched")
            self.assertEqual(self.settle(), ["wait", "capture"])
        finally:
            os.close(held)

    def test_a_new_task_that_includes_more_is_walked_and_watched(self):
        self.cp.init(self.root, "narrow", exclude=["gen"])
        self.assertEqual(self.tick(), "idle")
        self.assertEqual(self.tick(), "idle")
        self.write("gen/out.txt", "generated\n")
        self.assertFalse(self.needs_walk(), "a change under an excluded name woke the watcher")
        self.cp.init(self.root, "wide")  # gen/ is part of this task's workspace
        self.assertTrue(self.needs_walk(), "another task's start did not wake the watcher")
        self.settle()
        self.assertEqual(self.tick(), "idle")
        self.write("gen/out.txt", "edited, now a workspace file\n")
        self.assertTrue(self.needs_walk(), "gen/ is not watched for the new task")
        self.assertEqual(self.settle(), ["wait", "capture"])

    def test_switching_back_to_a_task_that_missed_an_edit_records_it(self):
        first = self.cp.resume(self.root)["task_id"]
        self.cp.init(self.root, "second")
        self.settle()
        self.write("top.txt", "changed under the second task\n")
        self.assertEqual(self.settle(), ["wait", "capture"])
        self.assertEqual(self.tick(), "idle")
        self.cp.switch(self.root, first)
        self.assertTrue(self.needs_walk(), "the switch did not wake the watcher")
        self.assertEqual(self.settle(), ["wait", "capture"])
        drift = self.cp.show(self.root, include_drift=True)["drifts"][-1]
        self.assertEqual(set(drift_paths(drift, "modified")), {"top.txt"})

    def test_stopping_the_watcher_closes_its_descriptor(self):
        fd = self.watcher.events.fd
        self.assertEqual(os.readlink("/proc/self/fd/%d" % fd), "anon_inode:inotify")
        self.cp.stop_watcher()
        self.assertIsNone(self.watcher.events.fd)
        self.assertFalse(os.path.exists("/proc/self/fd/%d" % fd)
                         and os.readlink("/proc/self/fd/%d" % fd) == "anon_inode:inotify")

    def test_lost_events_make_every_root_walk(self):
        self.watcher.events._event(-1, tc.IN_Q_OVERFLOW, b"")
        self.assertTrue(self.needs_walk())
        self.assertEqual(self.tick(), "idle")
        self.assertFalse(self.needs_walk())

    def test_a_failed_walk_is_retried_at_the_next_tick(self):
        task = self.cp.resume(self.root)["task_id"]
        state = os.path.join(self.store, "tasks", task, "state.json")
        with open(state, "rb") as fh:
            saved = fh.read()
        with open(state, "wb") as fh:
            fh.write(b"{ damaged")
        try:
            self.write("top.txt", "changed while the task state is unreadable\n")
            self.assertEqual(self.tick(), "error")
        finally:
            with open(state, "wb") as fh:
                fh.write(saved)
        self.assertTrue(self.needs_walk(), "a failed walk was not retried")
        self.assertEqual(self.settle(), ["wait", "capture"])

    def test_watches_take_a_share_of_the_user_budget(self):
        limit = tc.watch_dirs_limit()
        self.assertLessEqual(limit, tc.WATCH_DIRS_LIMIT)
        with open("/proc/sys/fs/inotify/max_user_watches") as fh:
            budget = int(fh.read())
        self.assertLessEqual(limit, budget // tc.WATCH_BUDGET_SHARE)

    def test_too_many_directories_fall_back_to_polling(self):
        self.watcher.events.dirs_limit = 3
        for name in "cdef":
            os.makedirs(os.path.join(self.root, name))
        self.assertEqual(self.tick(), "idle")
        watch = self.watcher.events.roots[self.root]
        self.assertTrue(watch.polling)
        self.assertEqual(watch.dirs, {}, "a polled root kept its kernel watches")
        self.assertTrue(self.needs_walk())
        self.write("top.txt", "seen by polling\n")
        self.assertEqual(self.settle(), ["wait", "capture"])

    def test_polling_for_too_many_directories_ends_when_they_are_gone(self):
        self.watcher.events.dirs_limit = 4
        for name in "cdef":
            os.makedirs(os.path.join(self.root, name))
        self.assertEqual(self.tick(), "idle")
        watch = self.watcher.events.roots[self.root]
        self.assertTrue(watch.polling)
        for name in "cdef":
            os.rmdir(os.path.join(self.root, name))
        self.assertEqual(self.tick(), "idle")
        self.assertTrue(watch.polling, "polling ended before its retry time")
        self.assertEqual(self.tick(tc.WATCH_RETRY_SECONDS), "idle")
        self.assertFalse(watch.polling, "a root stayed on polling after the burst was gone")
        self.assertEqual(self.tick(), "idle")  # the walk after new watches
        self.assertFalse(self.needs_walk())

    def test_a_folder_above_the_root_replaced_by_a_copy_is_walked(self):
        tmp = os.path.join(self.tmp, "outer")
        root = os.path.join(tmp, "p", "ws")
        os.makedirs(os.path.join(root, "a"))
        with open(os.path.join(root, "a", "f.txt"), "w") as fh:
            fh.write("one\n")
        self.cp.init(root, "deeper", store=os.path.join(tmp, "store"))
        for _ in range(2):
            self.now += 1
            self.watcher.tick(root, now=self.now)
        events = self.watcher.events
        self.assertFalse(events.needs_walk(root, self.now))
        shutil.copytree(os.path.join(tmp, "p"), os.path.join(tmp, "p.new"))
        os.rename(os.path.join(tmp, "p"), os.path.join(tmp, "p.old"))
        os.rename(os.path.join(tmp, "p.new"), os.path.join(tmp, "p"))
        self.assertTrue(events.needs_walk(root, self.now),
                        "a root put back as a copy kept its old watches unnoticed")
        self.now += 1
        self.watcher.tick(root, now=self.now)
        self.now += 1
        self.watcher.tick(root, now=self.now)
        with open(os.path.join(root, "a", "f.txt"), "w") as fh:
            fh.write("edited after the swap\n")
        self.assertTrue(events.needs_walk(root, self.now), "the copy is not watched")

    def test_a_root_no_longer_watched_gives_its_watches_back(self):
        events = self.watcher.events
        self.assertTrue(events.by_wd)
        events.keep_only([])
        self.assertEqual(events.by_wd, {})
        self.assertNotIn(self.root, events.roots)


MOUNT_SCRIPT = textwrap.dedent("""
    import os, shutil, subprocess, sys, tempfile
    sys.path.insert(0, sys.argv[1])
    import tc
    tmp = os.path.realpath(tempfile.mkdtemp(prefix="tc-mount-"))
    root = os.path.join(tmp, "ws")
    os.makedirs(os.path.join(root, "a"))
    other = os.path.join(tmp, "other")
    os.makedirs(other)
    cp = tc.Checkpoints(tc.Config(watch=True, watch_interval=3600, git=False))
    cp.init(root, "t")
    cp.start_watcher()
    now = [1000.0]
    def tick():
        now[0] += 1
        return cp.watcher.tick(root, now=now[0])
    tick(); tick()
    subprocess.run(["mount", "--bind", other, os.path.join(root, "a")], check=True)
    try:
        tick(); tick()
        with open(os.path.join(root, "a", "in-the-mount.txt"), "w") as fh:
            fh.write("x")
        print("needs_walk", cp.watcher.events.needs_walk(root, now[0]))
    finally:
        subprocess.run(["umount", os.path.join(root, "a")], check=True)
        cp.stop_watcher()
        shutil.rmtree(tmp, ignore_errors=True)
""")


@unittest.skipUnless(EVENTS and hasattr(os, "geteuid") and os.geteuid() == 0
                     and shutil.which("unshare") and shutil.which("mount"),
                     "needs root, unshare and mount")
class MountsInsideTheWorkspace(unittest.TestCase):

    def test_a_mount_over_a_watched_folder_is_watched(self):
        scripts = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                               "scripts")
        try:
            run = subprocess.run(["unshare", "-m", "--propagation", "private", sys.executable,
                                  "-c", MOUNT_SCRIPT, scripts],
                                 capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as exc:
            self.skipTest("no private mount namespace here: %s" % exc)
        if run.returncode != 0 and "needs_walk" not in run.stdout:
            self.skipTest("no private mount namespace here: %s" % run.stderr.strip()[-200:])
        self.assertIn("needs_walk True", run.stdout,
                      "a file made inside a folder mounted over a watched one went unnoticed")


if __name__ == "__main__":
    unittest.main()
