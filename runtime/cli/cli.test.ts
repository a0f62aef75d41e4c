import { execFile } from 'node:child_process';
import { readFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { promisify } from 'node:util';
import { describe, expect, it } from 'vitest';
import { STORIES260K, STORIES260K_GOLDEN, sharedPath } from '../../test/shared.ts';

const run = promisify(execFile);
const bin = join(dirname(fileURLToPath(import.meta.url)), '..', '..', 'bin', 'longtab.mjs');
const modelPath = sharedPath(STORIES260K);
const goldenPath = sharedPath(STORIES260K_GOLDEN);

async function longtab(...args: string[]) {
  return run(process.execPath, [bin, ...args], {
    env: { ...process.env, XDG_RUNTIME_DIR: '/tmp' },
    maxBuffer: 16 << 20,
  });
}

describe.skipIf(!modelPath || !goldenPath)('longtab CLI on stories260K', () => {
  it('info --json reports the architecture, parameters, tensor types and memory', async () => {
    const { stdout } = await longtab('info', modelPath!, '--json');
    const info = JSON.parse(stdout);
    expect(info.config).toMatchObject({
      architecture: 'llama',
      layers: 5,
      dim: 64,
      heads: 8,
      kvHeads: 4,
      headDim: 8,
      vocab: 512,
    });
    expect(info.tensorTypes).toEqual({ F32: { tensors: 48, bytes: expect.any(Number) } });
    expect(info.parameters).toBeGreaterThan(250_000);
    expect(info.memory.kvBytesPerTokenF16).toBe(2 * 5 * 4 * 8 * 2);
  });

  it('generate --json with an empty prompt decodes greedily from BOS to the golden ids', async () => {
    const golden = JSON.parse(readFileSync(goldenPath!, 'utf8')) as { greedy_ids: number[]; greedy_text: string };
    const expected = golden.greedy_ids.slice(1);
    const { stdout } = await longtab(
      'generate',
      '--model',
      modelPath!,
      '--prompt',
      '',
      '--max-tokens',
      String(expected.length),
      '--temperature',
      '0',
      '--seed',
      '1',
      '--json',
    );
    const out = JSON.parse(stdout);
    expect(out.ids).toEqual(expected);
    expect(out.text).toBe(golden.greedy_text);
    expect(out.usage.promptTokens).toBe(1);
    expect(out.usage.completionTokens).toBe(expected.length);
  });

  it('a missing file is a clear error with a non-zero exit code', async () => {
    await expect(longtab('info', '/nonexistent/model.gguf')).rejects.toMatchObject({ code: 1 });
  });
});
