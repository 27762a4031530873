"""Two server processes on one store at the same time.

Each server is a real `tc_mcp.py` process driven from its own thread. The
store lock must serialise them: step numbers stay unique and contiguous,
every record parses, every step's record belongs to the save that got its
number, and a restore running next to saves corrupts nothing. A call that
names no task acts on the task active when it gets the lock.
"""

import json
import os
import sys
import threading
import unittest

from support import SCRIPTS, WorkspaceTest, paths_of, snapshot, store_problems, write

sys.path.insert(0, SCRIPTS)
import tc  # noqa: E402

SAVES_PER_SERVER = 20


def run_threads(*targets):
    errors = []

    def guarded(target):
        try:
            target()
        except BaseException as exc:  # report every failure, not only the first
            errors.append("%s: %r" % (getattr(target, "__name__", target), exc))

    threads = [threading.Thread(target=guarded, args=(t,)) for t in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    alive = [t for t in threads if t.is_alive()]
    return errors + ["a worker never finished"] * len(alive)


class TwoServers(WorkspaceTest):

    def check_store(self, srv):
        health = srv.ok("tc_resume", root=self.root)["health"]
        self.assertTrue(health["ok"], health)
        self.assertEqual(health["errors"], [])
        self.assertEqual(store_problems(self.store), [])

    def saver(self, srv, tag, results, count=SAVES_PER_SERVER):
        def work():
            for i in range(count):
                write(self.root, "%s/file%02d.txt" % (tag, i), "%s wrote %d\n" % (tag, i))
                write(self.root, "%s/latest.txt" % tag, "%s at %d\n" % (tag, i))
                title = "%s save %d" % (tag, i)
                res = srv.call("tc_save", root=self.root, title=title,
                               conclusion="%s concluded %d" % (tag, i), next="%s next" % tag)
                if res.is_error:
                    raise AssertionError("%s refused: %s" % (title, res.text))
                results.append((res["index"], title, res["task_id"]))
        work.__name__ = "saver " + tag
        return work

    def test_parallel_saves_keep_unique_contiguous_numbers(self):
        first = self.server()
        second = self.server()
        task_id = first.ok("tc_init", root=self.root, name="shared work")["task_id"]
        write(self.root, "common.txt", "shared by both\n")
        results_a, results_b = [], []
        errors = run_threads(self.saver(first, "A", results_a),
                             self.saver(second, "B", results_b))
        self.assertEqual(errors, [])
        everything = results_a + results_b
        self.assertEqual({tid for _i, _t, tid in everything}, {task_id})
        indices = [index for index, _t, _tid in everything]
        self.assertEqual(sorted(indices), list(range(1, 2 * SAVES_PER_SERVER + 1)))
        for results in (results_a, results_b):
            own = [index for index, _t, _tid in results]
            self.assertEqual(own, sorted(own), "one server's numbers went backwards")
        self.check_store(first)

        titles = {index: title for index, title, _tid in everything}
        third = self.server()
        shown = third.ok("tc_show", root=self.root, limit=200, include_drift=True)
        drift_ids = [drift["id"] for drift in shown["drifts"]]
        self.assertEqual(len(drift_ids), len(set(drift_ids)))
        drift_files = os.listdir(os.path.join(self.store, "tasks", task_id, "drifts"))
        self.assertEqual(sorted(name[:-5] for name in drift_files if name.endswith(".json")),
                         sorted(drift_ids))
        self.assertEqual(sorted(s["index"] for s in shown["steps"]), sorted(titles))
        for step in shown["steps"]:
            self.assertEqual(step["title"], titles[step["index"]])
        for index in sorted(titles):
            one = third.ok("tc_show", root=self.root, index=index)
            self.assertEqual([s["index"] for s in one["steps"]], [index])
            self.assertEqual(one["steps"][0]["title"], titles[index])

        # Every step restores, and what it restores holds that save's own file.
        for index, title, _tid in sorted(everything)[::5]:
            third.ok("tc_restore", root=self.root, index=index, apply=True)
            tag, _save, number = title.split()
            self.assertEqual(snapshot(self.root)["%s/file%02d.txt" % (tag, int(number))][0],
                             ("%s wrote %s\n" % (tag, number)).encode())
            preview = third.ok("tc_restore", root=self.root, index=index)
            for key in ("to_delete", "to_write", "to_replace"):
                self.assertEqual(paths_of(preview["plan"][key]), set(), (index, key))
        self.check_store(third)

    def test_restore_on_one_server_while_the_other_saves(self):
        restorer = self.server()
        saver = self.server()
        restorer.ok("tc_init", root=self.root, name="restore next to saves")
        for i in range(30):
            write(self.root, "base/f%02d.txt" % i, "base one %d\n" % i)
        restorer.ok("tc_save", root=self.root, title="one", conclusion="c", next="n")
        for i in range(30):
            write(self.root, "base/f%02d.txt" % i, "base two %d, longer\n" % i)
        write(self.root, "base/only-two.txt", "two\n")
        restorer.ok("tc_save", root=self.root, title="two", conclusion="c", next="n")

        recovered = []

        def restore_back_and_forth():
            for i in range(8):
                res = restorer.call("tc_restore", root=self.root, index=1 + i % 2, apply=True)
                if res.is_error:
                    raise AssertionError("restore refused: " + res.text)
                recovered.append(res["recovered"])

        saved = []
        errors = run_threads(restore_back_and_forth, self.saver(saver, "S", saved, count=10))
        self.assertEqual(errors, [])
        self.assertEqual(len(recovered), 8)
        self.assertEqual(len(set(recovered)), 8)

        checker = self.server()
        self.check_store(checker)
        shown = checker.ok("tc_show", root=self.root, include_drift=True, limit=200)
        indices = sorted(step["index"] for step in shown["steps"])
        self.assertEqual(indices, list(range(1, 13)))
        self.assertEqual(sorted(index for index, _t, _tid in saved), list(range(3, 13)))

        # Every step and every recovered record restores cleanly, and after
        # each, the same preview has nothing left to do.
        for arguments in [{"index": i} for i in indices] + [{"drift_id": d} for d in recovered]:
            checker.ok("tc_restore", root=self.root, apply=True, **arguments)
            preview = checker.ok("tc_restore", root=self.root, **arguments)
            for key in ("to_delete", "to_write", "to_replace"):
                self.assertEqual(paths_of(preview["plan"][key]), set(), (arguments, key))
        checker.ok("tc_restore", root=self.root, index=1, apply=True)
        now = snapshot(self.root)
        for i in range(30):
            self.assertEqual(now["base/f%02d.txt" % i][0], ("base one %d\n" % i).encode())
        self.assertNotIn("base/only-two.txt", now)
        self.check_store(checker)


class SwitchWhileACallWaitsTests(WorkspaceTest):
    """A call that names no task acts on the task active when it runs. Two
    servers on one store: the second switches tasks after the first read the
    active task but before it got the store lock (as when it waited behind a
    long capture). Two core instances stand for the two processes here, so
    that the switch lands at exactly that moment."""

    def setUp(self):
        super().setUp()
        self.first = tc.Checkpoints(tc.Config(watch=False, git=False))
        self.second = tc.Checkpoints(tc.Config(watch=False, git=False))
        self.write("marker.txt", "one\n")
        self.one = self.first.init(self.root, "one")["task_id"]
        self.first.save(self.root, "one, first step")
        self.write("marker.txt", "two\n")
        self.two = self.first.init(self.root, "two")["task_id"]
        self.first.save(self.root, "two, first step")
        self.first.switch(self.root, self.one)

    def before_the_lock(self, action):
        """The second server runs action right after the first one resolved
        the workspace (read the active task and its state) for its next call."""
        real = self.first.workspaces.resolve
        done = []

        def resolved_then_acted(*args, **kwargs):
            ws = real(*args, **kwargs)
            if not done:
                done.append(True)
                action()
            return ws

        self.first.workspaces.resolve = resolved_then_acted

    def switch_before_the_lock(self):
        self.before_the_lock(lambda: self.second.switch(self.root, self.two))

    def active(self):
        with open(os.path.join(self.store, "current.json"), encoding="utf-8") as fh:
            return json.load(fh)["active"][os.path.realpath(self.root)]

    def test_a_save_records_into_the_task_switched_to_and_never_switches_back(self):
        self.write("marker.txt", "later work\n")
        self.switch_before_the_lock()
        saved = self.first.save(self.root, "after the switch")
        self.assertEqual(saved["task_id"], self.two)
        self.assertFalse(saved["active_task_changed"])
        self.assertEqual(saved["index"], 2)
        self.assertEqual(self.active(), self.two)

    def test_a_restore_restores_a_step_of_the_task_switched_to(self):
        self.write("marker.txt", "unsaved\n")
        self.switch_before_the_lock()
        self.first.restore(self.root, index=1, apply=True)
        self.assertEqual(self.read("marker.txt"), b"two\n")
        self.assertEqual(self.active(), self.two)

    def test_an_export_packs_the_task_switched_to(self):
        out = os.path.join(self.tmp, "out")
        os.makedirs(out)
        self.switch_before_the_lock()
        package = self.first.export(self.root, out)["path"]
        self.assertEqual(os.path.basename(package), self.two + "-handoff")
        self.assertEqual(os.listdir(out), [self.two + "-handoff"])

    def test_show_describes_the_task_switched_to(self):
        self.switch_before_the_lock()
        self.assertEqual(self.first.show(self.root)["steps"][0]["title"], "two, first step")

    def test_resume_describes_the_task_switched_to(self):
        self.switch_before_the_lock()
        self.assertEqual(self.first.resume(self.root)["last"]["title"], "two, first step")

    def test_resume_sees_a_capture_or_save_made_while_it_waited(self):
        self.write("marker.txt", "edited\n")
        self.before_the_lock(lambda: self.second.capture(self.root))
        resumed = self.first.resume(self.root)
        self.assertEqual((resumed["drift_paths"], resumed["changed_since_step"]),
                         ([], ["marker.txt"]))
        self.write("marker.txt", "edited again\n")
        self.first = tc.Checkpoints(tc.Config(watch=False, git=False))
        self.before_the_lock(lambda: self.second.save(self.root, "one, second step"))
        resumed = self.first.resume(self.root)
        self.assertEqual((resumed["head"], resumed["last"]["title"]), (2, "one, second step"))
        self.assertEqual(resumed["changed_since_step"], [])


class InitsChoosingStoresTests(WorkspaceTest):
    """Two sessions start a task in one workspace at once, one naming an
    external store and one not. The workspace names one store, so whichever
    way the two calls interleave, every task a call reported made must stay
    reachable from the workspace. Two core instances stand for the two
    processes, so that the second call lands while the first has chosen its
    store but not yet made its task."""

    def test_a_task_made_while_another_init_moves_the_store_stays_reachable(self):
        first = tc.Checkpoints(tc.Config(watch=False, git=False))
        second = tc.Checkpoints(tc.Config(watch=False, git=False))
        self.write("a.txt", "a\n")
        ext = os.path.join(self.tmp, "ext-store")
        made, problems = [], []
        real = first.setup._init_store_dir

        def second_init():
            try:
                made.append(second.init(self.root, "beta")["task_id"])
            except tc.CheckpointError as exc:
                problems.append(str(exc))

        def chose_then_raced(*args, **kwargs):
            chosen = real(*args, **kwargs)
            racer = threading.Thread(target=second_init)
            racer.start()
            racer.join(timeout=1.0)  # done by then unless something holds it back
            threads.append(racer)
            return chosen

        threads = []
        first.setup._init_store_dir = chose_then_raced
        made.append(first.init(self.root, "alpha", store=ext)["task_id"])
        for racer in threads:
            racer.join(timeout=60)
        self.assertEqual(problems, [])
        self.assertEqual(len(made), 2)
        fresh = tc.Checkpoints(tc.Config(watch=False, git=False))
        for task_id in made:
            self.assertEqual(fresh.switch(self.root, task_id)["task_id"], task_id)
            self.assertEqual(fresh.resume(self.root)["task_id"], task_id)

if __name__ == "__main__":
    unittest.main()
