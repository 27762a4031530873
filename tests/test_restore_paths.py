"""A restore to trust before and after, through a real server: some paths
only, a plan bound to its preview (plan_id), a receipt of what was read back,
the steps a restore undoes and a note for the conversation, and a step of
another task (a closed one) restored into the open task.

The receipt's race (another program writing a file right after the restore
wrote it) drives the core in-process, with the other program as a hook on the
real code path, as tests/test_races.py does.
"""

import os
import sys
import unittest

import support
from support import EditedMeanwhileTest, ToolsTest, paths_of, snapshot

sys.path.insert(0, support.SCRIPTS)
import tc  # noqa: E402


def task_files(store, task_id):
    """{path: bytes} of every file of a task's records."""
    top = os.path.join(store, "tasks", task_id)
    out = {}
    for dirpath, _dirnames, filenames in os.walk(top):
        for name in filenames:
            full = os.path.join(dirpath, name)
            with open(full, "rb") as fh:
                out[os.path.relpath(full, top)] = fh.read()
    return out


class RestoreTrustTest(ToolsTest):

    def restore(self, **arguments):
        return self.ok("tc_restore", root=self.root, **arguments)

    def two_steps(self):
        """Step 1 and step 2 differ in every file; then unsaved edits on top.
        Returns the task id."""
        task = self.init(name="paths")["task_id"]
        self.write("a.txt", "a at step 1\n")
        self.write("src/b.py", "b = 1\n")
        self.write("src/c.py", "c = 1\n")
        self.write("docs/d.md", "# d at step 1\n")
        self.save("one", conclusion="first")
        self.write("a.txt", "a at step 2\n")
        self.write("src/b.py", "b = 2\n")
        self.write("src/c.py", "c = 2\n")
        self.write("src/new.py", "made at step 2\n")
        os.remove(os.path.join(self.root, "docs", "d.md"))
        self.save("two", conclusion="second")
        self.write("a.txt", "a unsaved\n")
        self.write("src/b.py", "b unsaved\n")
        return task

    def unchanged(self):
        """What a refused call must leave: the workspace and the task records."""
        task = self.ok("tc_resume", root=self.root)["task_id"]
        return snapshot(self.root), task_files(self.store, task)


class PathsRestore(RestoreTrustTest):

    def test_one_file_out_of_a_changed_tree_and_its_undo(self):
        self.two_steps()
        before = snapshot(self.root)
        res = self.restore(index=1, paths=["src/b.py"], apply=True)
        self.assertEqual(res["plan"], {"to_delete": [], "to_write": [],
                                       "to_replace": ["src/b.py"], "unrestorable": []})
        self.assertEqual(res["head"], 2, "a paths restore moves no head")
        self.assertEqual(res["voided"], [])
        after = snapshot(self.root)
        self.assertEqual(self.read("src/b.py"), b"b = 1\n")
        self.assertEqual({k: v for k, v in after.items() if k != "src/b.py"},
                         {k: v for k, v in before.items() if k != "src/b.py"})
        self.assertIn("src/b.py", res["note"])
        self.assertIn(res["recovered"], res["note"])
        # Another edit after the restore: undoing it brings back src/b.py alone.
        self.write("a.txt", "a edited after the restore\n")
        moved_on = snapshot(self.root)
        undo = self.restore(drift_id=res["recovered"])
        self.assertEqual(undo["plan"]["to_replace"], ["src/b.py"])
        self.restore(drift_id=res["recovered"], apply=True)
        self.assertEqual(self.read("src/b.py"), b"b unsaved\n")
        self.assertEqual({k: v for k, v in snapshot(self.root).items() if k != "src/b.py"},
                         {k: v for k, v in moved_on.items() if k != "src/b.py"})
        self.assertEqual(self.ok("tc_show", root=self.root)["head"], 2)

    def test_a_folder_means_everything_under_it(self):
        self.two_steps()
        res = self.restore(index=1, paths=["src", "docs/"], apply=True)
        self.assertEqual(res["plan"]["to_replace"], ["src/b.py", "src/c.py"])
        self.assertEqual(res["plan"]["to_delete"], ["src/new.py"])
        self.assertEqual(res["plan"]["to_write"], ["docs/d.md"])
        self.assertEqual(self.read("src/c.py"), b"c = 1\n")
        self.assertEqual(self.read("docs/d.md"), b"# d at step 1\n")
        self.assertFalse(os.path.exists(os.path.join(self.root, "src", "new.py")))
        self.assertEqual(self.read("a.txt"), b"a unsaved\n")

    def test_a_file_outside_the_paths_in_the_way_of_them_stays_and_says_so(self):
        self.init(name="in the way")
        self.write("y/in.txt", "in the folder y\n")
        self.save("one")
        os.remove(os.path.join(self.root, "y", "in.txt"))
        os.rmdir(os.path.join(self.root, "y"))
        self.write("y", "a file named y now\n")
        res = self.restore(index=1, paths=["y/in.txt"], apply=True)
        self.assertEqual(res["plan"]["unrestorable"],
                         [{"path": "y/in.txt", "reason": "blocked by the file 'y' that stays "
                                                         "in place"}])
        self.assertEqual(self.read("y"), b"a file named y now\n")

    def test_typos_escapes_and_left_out_paths_are_refused_with_nothing_written(self):
        self.two_steps()
        self.write(".env", "TOKEN=1\n")
        self.write("node_modules/m/index.js", "x\n")
        state = self.unchanged()
        for paths, words in ((["src/b.py", "srcc/b.py"], ("'srcc/b.py'", "names nothing")),
                             (["../outside.txt"], ("'../outside.txt'", "'..'")),
                             (["src/../a.txt"], ("'src/../a.txt'",)),
                             (["/etc/passwd"], ("absolute",)),
                             ([".checkpoints/current.json"], ("store",)),
                             (["node_modules/m"], ("left out",)),
                             ([".env"], ("sensitive",)),
                             ([], ("at least one",))):
            for apply in (False, True):
                with self.subTest(paths=paths, apply=apply):
                    res = self.refused("tc_restore", root=self.root, index=1, paths=paths,
                                       apply=apply)
                    for word in words:
                        self.assertIn(word, res.text)
                    self.assertEqual(self.unchanged(), state)


class BoundToThePreview(RestoreTrustTest):

    def test_an_edit_between_preview_and_apply_refuses_and_writes_nothing(self):
        self.two_steps()
        preview = self.restore(index=1)
        self.assertRegex(preview["plan_id"], "^[0-9a-f]{64}$")
        self.assertIsNone(preview["receipt"])
        self.write("src/c.py", "c edited after the preview\n")
        state = self.unchanged()
        res = self.refused("tc_restore", root=self.root, index=1, apply=True,
                           plan_id=preview["plan_id"])
        self.assertIn("'src/c.py'", res.text)
        self.assertIn("Nothing was written", res.text)
        self.assertEqual(self.unchanged(), state)
        short = self.refused("tc_restore", root=self.root, index=1, apply=True,
                             plan_id=preview["plan_id"][:12])
        self.assertIn("must be 64 characters, got 12", short.text)
        self.assertIn("whole plan_id", short.text)
        self.assertEqual(self.unchanged(), state)
        # Previewed again, the same state gives the same id, and it applies.
        again = self.restore(index=1)
        self.assertNotEqual(again["plan_id"], preview["plan_id"])
        self.assertEqual(self.restore(index=1)["plan_id"], again["plan_id"])
        done = self.restore(index=1, apply=True, plan_id=again["plan_id"])
        self.assertEqual(done["plan_id"], again["plan_id"])
        self.assertEqual(self.read("src/c.py"), b"c = 1\n")

    def test_a_new_file_in_a_planned_folder_and_a_moved_head(self):
        self.two_steps()
        preview = self.restore(index=1, paths=["src"])
        self.write("src/appeared.py", "new since the preview\n")
        res = self.refused("tc_restore", root=self.root, index=1, paths=["src"], apply=True,
                           plan_id=preview["plan_id"])
        self.assertIn("'src/appeared.py'", res.text)
        preview = self.restore(index=1)
        self.save("three", conclusion="the task moved on")
        res = self.refused("tc_restore", root=self.root, index=1, apply=True,
                           plan_id=preview["plan_id"])
        self.assertIn("moved on", res.text)
        # Without plan_id an apply works as it always did.
        self.write("src/c.py", "edited again\n")
        self.restore(index=1, apply=True)
        self.assertEqual(self.read("src/c.py"), b"c = 1\n")


class VoidedAndNote(RestoreTrustTest):

    def test_restoring_step_2_of_5(self):
        self.init(name="five steps")
        for number in range(1, 6):
            self.write("f.txt", "f at step %d\n" % number)
            self.save("step %d" % number, conclusion="conclusion %d " % number + "x" * 400)
        preview = self.restore(index=2)
        res = self.restore(index=2, apply=True, plan_id=preview["plan_id"])
        self.assertEqual(preview["voided"], res["voided"])
        self.assertEqual([v["index"] for v in res["voided"]], [5, 4, 3])
        self.assertEqual(res["voided"][0]["title"], "step 5")
        self.assertTrue(res["voided"][0]["conclusion"].startswith("conclusion 5 x"))
        self.assertLess(len(res["voided"][0]["conclusion"]), 400)
        note = res["note"]
        self.assertIn("step 2", note)
        for title in ("step 5", "step 4", "step 3"):
            self.assertIn(title, note)
        self.assertIn('drift_id "%s"' % res["recovered"], note)
        self.assertEqual(res["receipt"], {"verified": 1, "mismatched": []})
        # Undoing it is a drift restore: its note names the record, nothing is voided.
        undo = self.restore(drift_id=res["recovered"], apply=True)
        self.assertEqual(undo["voided"], [])
        self.assertIn(res["recovered"], undo["note"])
        self.assertEqual(undo["head"], 5)
        # Back at step 2, a step 6 saved there: going to step 1 undoes 6 and 2,
        # not 3 to 5, which the first restore had undone already.
        self.restore(index=2, apply=True)
        self.write("f.txt", "f at step 6\n")
        self.assertEqual(self.save("step 6")["index"], 6)
        again = self.restore(index=1)
        self.assertEqual([v["index"] for v in again["voided"]], [6, 2])


class AnotherTasksStep(RestoreTrustTest):

    def test_a_closed_task_is_rolled_back_through_an_open_one(self):
        first = self.init(name="finished")["task_id"]
        self.write("app.py", "version 1\n")
        self.save("one", conclusion="works")
        self.write("app.py", "version 2, with the bug\n")
        self.save("two", conclusion="done", close=True)
        # Closed, and no task open: the preview and the refusal say how to go on.
        preview = self.restore(index=1)
        self.assertIn("open task", preview["note"])
        self.assertIn("tc_init", preview["note"])
        res = self.refused("tc_restore", root=self.root, index=1, apply=True)
        for words in ("closed", "tc_init", "task_id"):
            self.assertIn(words, res.text)
        res = self.refused("tc_restore", root=self.root, index=1, task_id="no-such-task")
        self.assertIn("'no-such-task'", res.text)
        records = task_files(self.store, first)
        second = self.init(name="fix the bug")["task_id"]
        res = self.restore(index=1, task_id=first, apply=True)
        self.assertEqual(self.read("app.py"), b"version 1\n")
        self.assertEqual(res["head"], 0)
        self.assertEqual(res["voided"], [])
        self.assertIn(first, res["note"])
        self.assertEqual(task_files(self.store, first), records, "the closed task changed")
        drifts = self.ok("tc_show", root=self.root, include_drift=True)["drifts"]
        self.assertEqual(drifts[-1]["id"], res["recovered"])
        self.assertEqual(drifts[-1]["kind"], "recovered")
        self.assertEqual(self.ok("tc_resume", root=self.root)["task_id"], second)
        # The record that undoes it is the open task's.
        self.restore(drift_id=res["recovered"], apply=True)
        self.assertEqual(self.read("app.py"), b"version 2, with the bug\n")


class Receipt(EditedMeanwhileTest):

    def test_a_file_a_racing_writer_changes_right_after_it_was_written(self):
        self.two_steps()
        original = tc.Journal.finish

        def finish(journal):  # every file is written; the journal is not yet gone
            tc.Journal.finish = original
            self.write("replaced.txt", "written by another program just after\n")
            return original(journal)

        tc.Journal.finish = finish
        self.addCleanup(setattr, tc.Journal, "finish", original)
        res = self.cp.restore(self.root, index=1, apply=True)
        self.assertEqual(paths_of(res["receipt"]["mismatched"]), {"replaced.txt"})
        self.assertIn("another program", res["receipt"]["mismatched"][0]["reason"])
        self.assertEqual(res["receipt"]["verified"], 3)  # written.txt, deleted.txt, plain.txt
        self.assertIn("receipt.mismatched", res["note"])
        errors = self.cp.resume(self.root)["health"]["errors"]
        self.assertTrue(any("replaced.txt" in e and res["recovered"] in e for e in errors),
                        errors)
        self.cp.save(self.root, "three")
        self.assertEqual(self.cp.resume(self.root)["health"]["errors"], [])


class SkillTeachesIt(unittest.TestCase):
    """What an agent reads first says how to restore with all this."""

    def section(self, text, title):
        start = text.index("\n## " + title)
        end = text.find("\n## ", start + 1)
        return text[start:end if end > 0 else len(text)]

    def test_preview_with_diff_apply_with_plan_id_paste_the_note_and_go_back_after_a_close(self):
        with open(os.path.join(support.REPO, "SKILL.md"), encoding="utf-8") as fh:
            skill = fh.read()
        restoring = self.section(skill, "Restoring")
        for words in ("`diff: true`", "`plan_id`", "`note`", "paste", "`paths`", "`voided`",
                      "`receipt.mismatched`"):
            self.assertIn(words, restoring)
        closing = self.section(skill, "Closing")
        for words in ("fix forward", "`tc_init`", "`task_id`", "closed"):
            self.assertIn(words, closing)


if __name__ == "__main__":
    unittest.main()
