/**
 * The one way tests reach ../shared (models, corpora): LONGTAB_SHARED or ../shared next to the checkout.
 * When it is absent (a user's fresh clone) the tests that need it skip with a loud message instead of failing.
 */
import { existsSync } from 'node:fs';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';

const repoRoot = resolve(dirname(fileURLToPath(import.meta.url)), '..');
export const sharedRoot = resolve(process.env.LONGTAB_SHARED ?? join(repoRoot, '..', 'shared'));

/** Absolute path of a file under shared/, or null (with a warning) when it is missing. */
export function sharedPath(relative: string): string | null {
  const path = join(sharedRoot, relative);
  if (existsSync(path)) return path;
  console.warn(
    `\n*** SKIPPING: ${relative} is not available (looked in ${sharedRoot}). Set LONGTAB_SHARED to the shared/ folder to run this test. ***\n`,
  );
  return null;
}

export const STORIES260K = 'models/stories260K/stories260K.gguf';
export const STORIES260K_GOLDEN = 'models/stories260K/golden-greedy.json';
