/**
 * Fault records: each robustness test appends what it tried and what happened, one JSON object per line, to
 * tmp/faults/<suite>.jsonl; `npx tsx tools/fault-table.ts` renders them as docs/faults.md. The records live outside
 * test-results/ because Playwright empties that folder at the start of every run.
 */
import { appendFileSync, mkdirSync, writeFileSync } from 'node:fs';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';

export const FAULTS_DIR = resolve(dirname(fileURLToPath(import.meta.url)), '..', '..', 'tmp', 'faults');

export interface FaultRecord {
  /** Which part of the system was attacked: loader, device, session, sources, page, … */
  area: string;
  /** The fault or bad input, in words. */
  fault: string;
  /** What a correct runtime does. */
  expected: string;
  /** What happened (an error class and code, "loaded", a count). */
  outcome: string;
  /** Whether the outcome met the expectation. */
  ok: boolean;
  /** How many inputs of this kind were tried (fuzz runs). */
  count?: number;
}

export interface FaultLog {
  record(entry: FaultRecord): void;
}

/** A log for one suite: starts the suite's file empty, so a run only reports what that run tried. */
export function faultLog(suite: string): FaultLog {
  const path = join(FAULTS_DIR, `${suite}.jsonl`);
  mkdirSync(FAULTS_DIR, { recursive: true });
  writeFileSync(path, '');
  return {
    record(entry) {
      appendFileSync(path, `${JSON.stringify({ suite, ...entry })}\n`);
    },
  };
}

/** "CorruptModelFileError (corrupt-model-file)" for a LongtabError, the constructor name otherwise. */
export function describeError(error: unknown): string {
  if (error && typeof error === 'object') {
    const name = (error as { name?: string }).name ?? error.constructor?.name ?? 'Error';
    const code = (error as { code?: unknown }).code;
    return typeof code === 'string' ? `${name} (${code})` : name;
  }
  return typeof error;
}

/** The error a promise rejects with, or null once it resolves: the outcome to record before asserting on it. */
export async function rejectionOf(promise: Promise<unknown>): Promise<unknown> {
  try {
    await promise;
    return null;
  } catch (error) {
    return error;
  }
}

type ErrorClass = abstract new (...args: never[]) => Error;

/** Whether `error` is a `type` whose message matches `message`: the test's own assertion as a boolean, for `ok`. */
export function isRefusal(error: unknown, type: ErrorClass, message?: RegExp | string): boolean {
  if (!(error instanceof type)) return false;
  if (message === undefined) return true;
  return typeof message === 'string' ? error.message.includes(message) : message.test(error.message);
}

/**
 * describeError and the message from where `message` matched to the end of that sentence (`DownloadFailedError
 * (download-failed): "stopped answering (probe): no response within 0.2 s"`), or the message's start where it did not
 * match, so a row that is not ok says what came instead. Text before the match (a URL with a port) stays out.
 */
export function describeRefusal(error: unknown, message?: RegExp | string): string {
  if (error === null || error === undefined) return 'no error';
  if (message === undefined) return describeError(error);
  const text = error instanceof Error ? error.message : String(error);
  const excerpt = (s: string) => (s.length > 120 ? `${s.slice(0, 119)}…` : s);
  const at = typeof message === 'string' ? text.indexOf(message) : (text.match(message)?.index ?? -1);
  if (at < 0) return `${describeError(error)}, message "${excerpt(text)}"`;
  const matchEnd = at + (typeof message === 'string' ? message.length : text.match(message)![0].length);
  const sentenceEnd = text.indexOf('. ', matchEnd);
  return `${describeError(error)}: "${excerpt(text.slice(at, sentenceEnd < 0 ? text.length : sentenceEnd + 1))}"`;
}
