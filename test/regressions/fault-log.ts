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
