import { execFile } from 'node:child_process';
import { readFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { promisify } from 'node:util';
import { describe, expect, it } from 'vitest';
import { InvalidRequestError } from '../../core/errors.ts';
import { faultLog } from '../../test/regressions/fault-log.ts';
import { STORIES260K, STORIES260K_GOLDEN, sharedPath } from '../../test/shared.ts';
import { pairedPerplexityRatioInterval } from '../eval/perplexity.ts';
import { parseArgs } from './args.ts';
import { checkModesFitModel, evalLoadOptions, kvOptionsFor } from './eval.ts';
import { COMMANDS, USAGE, usageOf } from './main.ts';

const run = promisify(execFile);
const bin = join(dirname(fileURLToPath(import.meta.url)), '..', '..', 'bin', 'longtab.mjs');
const modelPath = sharedPath(STORIES260K);
const goldenPath = sharedPath(STORIES260K_GOLDEN);
const tinyStoriesPath = sharedPath('corpora/tinystories/TinyStories-valid-30KB-subset.txt');
const log = faultLog('cli');

async function longtab(...args: string[]) {
  return run(process.execPath, [bin, ...args], {
    env: { ...process.env, XDG_RUNTIME_DIR: '/tmp' },
    maxBuffer: 16 << 20,
  });
}

describe('eval KV modes', () => {
  it('MODE+L5.6 boosts those layers of an int2 mode; other suffixes and f16 are refused with a typed error', () => {
    const boosted = (rotation: string, boostLayers: number[]) => ({
      kv: 'int2',
      rotation,
      experimental: { boostLayers },
    });
    expect(kvOptionsFor('int2-none+L5')).toEqual(boosted('none', [5]));
    expect(kvOptionsFor('int2-hadamard+L0.12')).toEqual(boosted('hadamard', [0, 12]));
    expect(kvOptionsFor('int2-calibrated+L5')).toEqual({
      kv: 'int2',
      rotation: 'calibrated',
      experimental: { precisionPlan: 'uniform', boostLayers: [5] },
    });
    // 'int2' is what a user gets with kv: 'int2' once calibrated: calibrated rotations and their precision plan.
    expect(kvOptionsFor('int2')).toEqual({ kv: 'int2', rotation: 'calibrated' });
    expect(kvOptionsFor('int1-none+L5')).toEqual({
      kv: 'int2',
      rotation: 'none',
      experimental: { codeBits: 1, boostLayers: [5] },
    });
    expect(() => kvOptionsFor('f16+L5')).toThrow(InvalidRequestError);
    expect(() => kvOptionsFor('int2+Lx')).toThrow(/\+L5/);
    expect(() => kvOptionsFor('int2+L5+L6')).toThrow(InvalidRequestError);
  });

  it('load options from flags go through parseLoadOptions: defaults, the experimental knobs, typed errors', () => {
    const flags = (...argv: string[]) => parseArgs(['eval', ...argv], COMMANDS);
    expect(evalLoadOptions(flags(), 'f16')).toMatchObject({ kv: 'f16', prefillChunk: 64, sink: 64, window: 256 });
    const options = evalLoadOptions(
      flags('--sink', '16', '--window', '32', '--group-size', '32', '--prefill-matmul', 'f32', '--kv-budget', '4096'),
      'int1-none',
    );
    expect(options).toMatchObject({
      kv: 'int2',
      rotation: 'none',
      codeBits: 1,
      sink: 16,
      window: 32,
      groupSize: 32,
      prefillMatmul: 'f32',
      prefillAttention: 'auto',
      kvBudgetBytes: 4096,
    });
    expect(options.rotationCache).toBeUndefined();
    expect(evalLoadOptions(flags(), 'int2-calibrated').rotationCache).toBeDefined();
    expect(() => evalLoadOptions(flags('--prefill-attention', 'int4'), 'f16')).toThrow(
      /experimental\.prefillAttention = "int4" is invalid/,
    );
    expect(() => evalLoadOptions(flags('--sink', '-1'), 'int2')).toThrow(InvalidRequestError);
    expect(() => evalLoadOptions(flags('--chunk', '0'), 'int2')).toThrow(/prefillChunk = 0 is invalid/);
    // The 1-bit control cannot boost layers (they are a tier of the 2-bit cache).
    expect(() => evalLoadOptions(flags(), 'int1-none+L5')).toThrow(/2-bit codes/);
  });
});

describe('command line', () => {
  it('each command takes exactly the flags its usage lists', () => {
    const listed = new Map<string, Set<string>>();
    let command = '';
    for (const line of USAGE.split('\n')) {
      const head = /^ {2}longtab (\w+)/.exec(line);
      if (head) command = head[1];
      if (!command) continue;
      const set = listed.get(command) ?? new Set<string>();
      for (const m of line.matchAll(/--([a-z][a-z0-9-]*)/g)) set.add(m[1]);
      listed.set(command, set);
    }
    expect([...listed.keys()].sort()).toEqual(Object.keys(COMMANDS).sort());
    for (const [name, spec] of Object.entries(COMMANDS)) {
      expect([...(listed.get(name) ?? [])].sort(), name).toEqual([...spec.values, ...spec.switches].sort());
    }
  });

  it('a typo, a stray argument or a misused flag is a typed error that lists what the command takes', () => {
    const parse = (...argv: string[]) => parseArgs(argv, COMMANDS);
    expect(() => parse('generate', '--max_tokens', '3')).toThrow(InvalidRequestError);
    expect(() => parse('generate', '--max_tokens', '3')).toThrow(
      /'--max_tokens'.*'generate' takes --model VALUE.*--max-tokens VALUE/,
    );
    expect(() => parse('generate', 'once upon a time')).toThrow(
      /Unexpected argument 'once upon a time'.*no positional/,
    );
    expect(() => parse('info', 'a.gguf', 'b.gguf')).toThrow(/Unexpected argument 'b.gguf'.*one FILE/);
    expect(() => parse('eval', '--json=yes')).toThrow(/'--json' does not take an argument/);
    expect(() => parse('eval', '--ctx')).toThrow(/'--ctx <value>' argument missing/);
    expect(() => parse('eval', '--ctx', '--json')).toThrow(/'--ctx' argument is ambiguous/);
    expect(parse('generate', '--max-tokens', '3', '--json')).toMatchObject({
      command: 'generate',
      positional: [],
      flags: new Map<string, string | true>([
        ['max-tokens', '3'],
        ['json', true],
      ]),
    });
    expect(parse('eval', 'a.txt', 'b.txt', '--ctx=64').positional).toEqual(['a.txt', 'b.txt']);
    expect(parse('help', 'anything').command).toBe('help');
  });

  it("`CMD --help` (or -h, or `help CMD`) prints that command's usage, every form of it, and exits 0", async () => {
    const parse = (...argv: string[]) => parseArgs(argv, COMMANDS);
    expect(parse('eval', '--ctx', '64', '--help')).toEqual({ command: 'help', positional: ['eval'], flags: new Map() });
    expect(parse('info', '-h').positional).toEqual(['info']);
    for (const command of Object.keys(COMMANDS)) {
      const own = usageOf(command);
      expect(own, command).toContain(`longtab ${command} `);
      for (const other of Object.keys(COMMANDS).filter((c) => c !== command)) {
        expect(own, `${command} shows ${other}`).not.toContain(`longtab ${other} `);
      }
    }
    expect(usageOf('eval').match(/ {2}longtab eval /g)).toHaveLength(2);
    expect(usageOf('nonsense')).toBe(USAGE);
    const { stdout } = await longtab('calibrate', '--help');
    expect(stdout).toBe(usageOf('calibrate'));
    expect(stdout).toContain('--plan-only');
    expect((await longtab('help', 'calibrate')).stdout).toBe(stdout);
  });

  it('the CLI refuses an unknown flag before it loads anything', async () => {
    await expect(longtab('generate', '--max_tokens', '3')).rejects.toMatchObject({
      code: 1,
      stderr: expect.stringMatching(/InvalidRequestError: Unknown option '--max_tokens'\. 'generate' takes/),
    });
  });
});

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

  it.skipIf(!tinyStoriesPath)(
    'eval --json: perplexity per mode, a paired interval on the ratio to f16, progress on stderr',
    async () => {
      // A 32-token f16 window, a 4-token sink (one 16-token page) and 16-token prefill chunks, so that the later
      // queries of each 128-token window read most of their history from INT2 pages.
      const { stdout, stderr } = await longtab(
        'eval',
        '--model',
        modelPath!,
        '--text',
        tinyStoriesPath!,
        '--ctx',
        '128',
        '--max-windows',
        '4',
        '--kv',
        'f16,int2-none',
        '--window',
        '32',
        '--sink',
        '4',
        '--chunk',
        '16',
        '--json',
      );
      const out = JSON.parse(stdout);
      const [f16, naive] = out.results;
      expect(f16.kv).toBe('f16');
      expect(f16.windowMeanNll).toHaveLength(4);
      expect(f16.vsF16Interval95).toBeUndefined();
      // The whole-text perplexity is the exponentiated mean of the per-window mean NLLs (equal windows).
      const mean = (xs: number[]) => xs.reduce((s, x) => s + x, 0) / xs.length;
      expect(Math.log(naive.perplexity)).toBeCloseTo(mean(naive.windowMeanNll), 9);
      expect(naive.vsF16).toBeGreaterThan(0.1);
      // The reported interval is the paired one over the reported windows, around the reported ratio.
      expect(naive.vsF16Interval95).toEqual(pairedPerplexityRatioInterval(naive.windowMeanNll, f16.windowMeanNll));
      expect(naive.vsF16Interval95.low).toBeLessThan(naive.vsF16);
      expect(naive.vsF16Interval95.high).toBeGreaterThan(naive.vsF16);
      expect(stderr).toMatch(/\[f16\] 4 windows of 128: perplexity \d+\.\d{3}/);
      expect(stderr).toMatch(/\[int2-none\] 4 windows of 128: perplexity \d+\.\d{3}/);
    },
  );

  it('eval refuses a boosted layer the model lacks before any mode runs', async () => {
    // stories260K has layers 0..4; the bad mode is last, after modes that would otherwise run first.
    await expect(
      longtab('eval', '--model', modelPath!, '--text', goldenPath!, '--kv', 'f16,int2-none,int2-none+L7'),
    ).rejects.toMatchObject({
      code: 1,
      stderr: expect.stringContaining("'int2-none+L7': the model has layers 0..4, not 7."),
    });
    await expect(checkModesFitModel(['f16', 'int2-none+L4'], modelPath!)).resolves.toBeUndefined();
  });

  // Dawn may print its own warnings first; the CLI's is the last line.
  it('a missing file, a directory or a missing text file: one line naming the path, exit code 1, no stack trace', async () => {
    const oneLine = (pattern: RegExp) => ({ code: 1, stderr: expect.stringMatching(pattern) });
    const refusals: Array<[string[], RegExp]> = [
      [
        ['info', '/nonexistent/model.gguf'],
        /(^|\n)longtab: InvalidRequestError: .*\/nonexistent\/model\.gguf: there is no file at that path\.\n$/,
      ],
      [
        ['info', '/tmp'],
        /(^|\n)longtab: InvalidRequestError: Cannot open the model file \/tmp: it is a directory\.\n$/,
      ],
      [
        ['eval', '--model', '/tmp', '--text', 'README.md', '--kv', 'f16'],
        /(^|\n)longtab: InvalidRequestError: Cannot open the model file \/tmp: it is a directory\.\n$/,
      ],
      // The text is read before the model: a wrong text path fails at once.
      [
        ['eval', '--model', '/tmp', '--text', '/nonexistent/text.txt', '--kv', 'f16'],
        /(^|\n)longtab: InvalidRequestError: Cannot read the text file \/nonexistent\/text\.txt: there is no file at that path\.\n$/,
      ],
    ];
    for (const [args, pattern] of refusals) {
      const failure = await longtab(...args).then(
        () => null,
        (error: { code: number; stderr: string }) => error,
      );
      const stackTrace = failure !== null && /\n\s+at /.test(failure.stderr);
      log.record({
        area: 'files',
        fault: `longtab ${args.join(' ')}`,
        expected: 'exit code 1; one line "longtab: InvalidRequestError: …" naming the path; no stack trace',
        outcome:
          failure === null
            ? 'exit code 0'
            : `exit code ${failure.code}; ${stackTrace ? 'a stack trace' : `"${failure.stderr.trim().split('\n').at(-1)}"`}`,
        ok: failure !== null && failure.code === 1 && pattern.test(failure.stderr) && !stackTrace,
      });
      expect(failure, args.join(' ')).toMatchObject(oneLine(pattern));
      expect(failure!.stderr, args.join(' ')).not.toMatch(/\n\s+at /);
    }
  });
});
