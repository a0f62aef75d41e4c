import { existsSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { InvalidRequestError } from '../../core/errors.ts';

/** The embedded demo model under public/models/, the CLI's default. */
export const DEMO_MODEL_FILE = 'longtab-demo.gguf';

export function defaultModelPath(): string {
  const path = join(dirname(fileURLToPath(import.meta.url)), '..', '..', 'public', 'models', DEMO_MODEL_FILE);
  if (!existsSync(path)) {
    throw new InvalidRequestError(
      `No --model given and the embedded demo model (${path}) is not there: pass --model FILE.gguf.`,
    );
  }
  return path;
}
