#!/usr/bin/env node
/*
 * Launcher for the task-checkpoint-mcp MCP server.
 *
 * The server itself is the Python package `task-checkpoint-mcp` (module
 * `tc_mcp`). This script only finds a Python 3.10+ interpreter that can import
 * tc_mcp and runs `python -m tc_mcp <arguments>` with stdin, stdout and stderr
 * handed straight through, so the MCP frames never pass through Node.
 *
 * Interpreter search order: $TC_PYTHON, then python3 and python on PATH, then
 * (Windows only) the `py -3` launcher. When none of them has the package, the
 * `tc-mcp` command on PATH is used, which is what `pipx install` provides: its
 * Python lives in a virtual environment of its own. `--version` and `--help`
 * are answered here and need no Python at all.
 */
'use strict';

const childProcess = require('node:child_process');
const os = require('node:os');
const path = require('node:path');

const PACKAGE = require(path.join(__dirname, '..', 'package.json'));
const MIN_PYTHON = [3, 10];
const PROBE_TIMEOUT_MS = 30000;
const INSTALL_COMMAND = 'pipx install task-checkpoint-mcp';
const FORWARDED_SIGNALS = process.platform === 'win32'
  ? ['SIGINT', 'SIGTERM', 'SIGBREAK']
  : ['SIGINT', 'SIGTERM', 'SIGHUP'];

// Prints "major.minor" before importing, so a too-old interpreter is reported
// as such even when tc_mcp does not import there. The working directory
// (usually the user's project) is taken off sys.path first: a project's own
// json.py must not be imported in place of the standard library's.
const PROBE = [
  'import sys',
  'sys.path[:] = sys.path[1:] if sys.path[:1] == [""] else sys.path',
  'sys.stdout.write("%d.%d\\n" % sys.version_info[:2])',
  'sys.stdout.flush()',
  'import tc_mcp',
].join('; ');
// Python 3.11+ can leave the working directory off sys.path (-P) for the
// server too; on 3.10 tc_mcp takes it off itself as it starts.
const SAFE_PATH_PYTHON = [3, 11];
// The console script the Python package installs (pipx puts it on PATH).
const SERVER_COMMAND = 'tc-mcp';
const SERVER_VERSION = /^task-checkpoint-mcp \d/;

function helpText() {
  return [
    `${PACKAGE.name} ${PACKAGE.version} (npm launcher)`,
    '',
    'Starts the task-checkpoint-mcp stdio MCP server, which is a Python package.',
    'This launcher finds a Python 3.10+ interpreter that can import tc_mcp and',
    'runs `python -m tc_mcp` with the remaining arguments, stdio passed through.',
    '',
    'Usage:',
    '  npx -y task-checkpoint-mcp [server arguments]',
    '  npx -y task-checkpoint-mcp --version | --help',
    '',
    'Install the server first:',
    `  ${INSTALL_COMMAND}        (or: pip install task-checkpoint-mcp)`,
    '',
    'Interpreter search order:',
    '  1. TC_PYTHON          path or name of the interpreter to use',
    '  2. python3, python    on PATH',
    '  3. py -3              Windows only',
    `  4. ${SERVER_COMMAND}             on PATH (a pipx install), run as it is`,
    '',
    'Server flags (answered by Python): --print-skill, --skill-path,',
    '  --install-skill DIR [--force]. Run `python -m tc_mcp --help` for the list.',
    '',
  ].join('\n');
}

function candidates(env, platform) {
  const list = [];
  if (env.TC_PYTHON) {
    list.push({ command: env.TC_PYTHON, prefix: [], label: `TC_PYTHON (${env.TC_PYTHON})` });
  }
  list.push({ command: 'python3', prefix: [], label: 'python3' });
  list.push({ command: 'python', prefix: [], label: 'python' });
  if (platform === 'win32') {
    list.push({ command: 'py', prefix: ['-3'], label: 'py -3' });
  }
  list.push({ command: SERVER_COMMAND, prefix: [], label: `${SERVER_COMMAND} on PATH`,
              server: true });
  return list;
}

function versionAtLeast(found, wanted) {
  for (let i = 0; i < wanted.length; i += 1) {
    if (found[i] !== wanted[i]) return found[i] > wanted[i];
  }
  return true;
}

function lastLine(text) {
  const lines = String(text || '').trim().split(/\r?\n/);
  return lines[lines.length - 1] || '';
}

/** The installed server command: usable when it answers --version as itself. */
function probeServer(candidate) {
  const result = childProcess.spawnSync(
    candidate.command, ['--version'],
    { encoding: 'utf8', timeout: PROBE_TIMEOUT_MS, windowsHide: true,
      stdio: ['ignore', 'pipe', 'pipe'] });
  if (result.error) {
    return result.error.code === 'ENOENT' ? 'not found' : `could not run (${result.error.code || result.error.message})`;
  }
  if (result.status !== 0 || !SERVER_VERSION.test(String(result.stdout || '').trim())) {
    return `did not answer --version as ${PACKAGE.name} (${lastLine(result.stderr) || `exit ${result.status}`})`;
  }
  return null;
}

/** Returns null when the candidate is usable, otherwise a one-line reason. */
function probe(candidate) {
  if (candidate.server) return probeServer(candidate);
  const result = childProcess.spawnSync(
    candidate.command, [...candidate.prefix, '-c', PROBE],
    { encoding: 'utf8', timeout: PROBE_TIMEOUT_MS, windowsHide: true,
      stdio: ['ignore', 'pipe', 'pipe'] });
  if (result.error) {
    return result.error.code === 'ENOENT' ? 'not found' : `could not run (${result.error.code || result.error.message})`;
  }
  const match = /^(\d+)\.(\d+)/.exec(String(result.stdout || '').trim());
  if (!match) {
    return `did not start as Python (exit ${result.status})`;
  }
  const version = [Number(match[1]), Number(match[2])];
  candidate.version = version;
  if (!versionAtLeast(version, MIN_PYTHON)) {
    return `Python ${version.join('.')} is older than ${MIN_PYTHON.join('.')}`;
  }
  if (result.status !== 0) {
    return `Python ${version.join('.')} cannot import tc_mcp (${lastLine(result.stderr) || `exit ${result.status}`})`;
  }
  return null;
}

function findPython(env, platform) {
  const rejected = [];
  for (const candidate of candidates(env, platform)) {
    const reason = probe(candidate);
    if (reason === null) return { found: candidate, rejected };
    rejected.push(`${candidate.label}: ${reason}`);
  }
  return { found: null, rejected };
}

function reportMissing(rejected) {
  const lines = [
    `${PACKAGE.name}: no Python ${MIN_PYTHON.join('.')}+ with the task-checkpoint-mcp package was found.`,
    ...rejected.map((line) => `  - ${line}`),
    '',
    'Install the server (it is a Python package), then run this again:',
    `  ${INSTALL_COMMAND}`,
    'or point TC_PYTHON at an interpreter that has it installed.',
    '',
  ];
  process.stderr.write(lines.join('\n'));
}

function exitLike(code, signal) {
  if (signal) {
    for (const sig of FORWARDED_SIGNALS) process.removeAllListeners(sig);
    if (process.platform !== 'win32') {
      try {
        process.kill(process.pid, signal);
      } catch (err) {
        // Fall through to a numeric exit code.
      }
    }
    process.exit(128 + (os.constants.signals[signal] || 1));
  }
  process.exit(code === null ? 1 : code);
}

function run(candidate, args) {
  const safePath = candidate.version && versionAtLeast(candidate.version, SAFE_PATH_PYTHON)
    ? ['-P'] : [];
  const argv = candidate.server ? args
    : [...candidate.prefix, ...safePath, '-m', 'tc_mcp', ...args];
  const child = childProcess.spawn(candidate.command, argv,
    { stdio: 'inherit', windowsHide: true });
  for (const sig of FORWARDED_SIGNALS) {
    process.on(sig, () => {
      if (child.exitCode === null && child.signalCode === null) {
        try {
          child.kill(sig);
        } catch (err) {
          // The child is already gone; its exit event ends this process.
        }
      }
    });
  }
  child.on('error', (err) => {
    process.stderr.write(`${PACKAGE.name}: could not start ${candidate.label}: ${err.message}\n`);
    process.exit(1);
  });
  child.on('exit', exitLike);
}

function main(argv) {
  if (argv.includes('--version')) {
    process.stdout.write(`${PACKAGE.name} ${PACKAGE.version}\n`);
    return;
  }
  if (argv.includes('--help') || argv.includes('-h')) {
    process.stdout.write(helpText());
    return;
  }
  const { found, rejected } = findPython(process.env, process.platform);
  if (!found) {
    reportMissing(rejected);
    process.exit(1);
  }
  if (rejected.length > 0 && process.env.TC_PYTHON) {
    process.stderr.write(`${PACKAGE.name}: ignoring ${rejected[0]}; using ${found.label}\n`);
  }
  run(found, argv);
}

try {
  main(process.argv.slice(2));
} catch (err) {
  process.stderr.write(`${PACKAGE.name}: ${err && err.message ? err.message : String(err)}\n`);
  process.exit(1);
}
