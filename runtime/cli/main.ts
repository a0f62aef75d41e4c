/**
 * `longtab` — the Node CLI on the same engine as the browser (WebGPU through Dawn; any Vulkan driver, CPU ones too).
 */

import { LongtabError } from '../../core/errors.ts';
import { acquireGpu } from '../../core/gpu/device.ts';
import { nodeGpu, releaseNodeGpu } from '../../core/gpu/node.ts';
import { type CommandSpec, numberFlag, type ParsedArgs, parseArgs, stringFlag } from './args.ts';
import { runCalibrate } from './calibrate.ts';
import { runCapacity } from './capacity.ts';
import { runEval } from './eval.ts';
import { runFidelity } from './fidelity.ts';
import { runGenerate } from './generate.ts';
import { runInfo } from './info.ts';

export const USAGE = `longtab — a local LLM runtime on WebGPU

  longtab info FILE [--json]
      architecture, parameter count, tensor types and a memory estimate
  longtab generate [--model FILE] [--prompt TEXT] [--chat] [--kv f16|int2] [--max-tokens N] [--temperature T]
                   [--top-k K] [--top-p P] [--min-p P] [--repetition-penalty R] [--seed S] [--json]
      an empty prompt means BOS only; --json prints { ids, text, usage }
  longtab eval [--model FILE] --text FILE [FILE...] [--ctx N] [--kv f16[,MODE...]] [--compare] [--max-windows W]
      [--prefill-matmul auto|f32|int8-dot] [--prefill-attention auto|f32|int8-dot] [--json]
      [--chunk N] [--kv-budget BYTES] [--sink S] [--window W] [--group-size G] (these two forms alike)
      perplexity over non-overlapping windows of N tokens, per KV mode; --compare adds top-1 agreement with f16
  longtab eval --task passkey|copy|recall [--model FILE] --text FILLER [FILE...] [--lengths L,...]
               [--depths D,...] (copy: [--distances N,...]) [--trials 200] [--seed S] [--kv f16[,MODE...]] [--compare]
               [--digits 5] [--pairs 8 --queries 4 --value-digits 3] [--copy-tokens 64] [--json] [--quiet]
      retrieval accuracy with Wilson 95% intervals per KV mode × length × needle depth (copy: distance in tokens),
      one teacher-forced prefill per trial, the same seeded trials for every mode
  longtab capacity [--model FILE] --kv-budget BYTES [--kv f16,int2,int2+L5] [--decode-steps N] [--json]
      per KV mode, the longest context the budget holds and its bits per element, found by allocating it
  longtab calibrate [--model FILE] [--out FILE.bin] [--embed OUT.gguf] [--text FILE] [--tokens N] [--seed S]
                    [--plan-only]
      fits the int2 cache's KV rotations (OSCAR) on self-generated text (or --text); caches them by model digest
  longtab fidelity [--model FILE] --text FILE [--ctx N] [--windows W] [--modes f16,int2-none,...]
                   [--sink S] [--window W] [--group-size G] [--chunk N] [--json]
      per layer, attention output error and attention-weight KL of each quantized KV cache against f16
`;

/** The flags and arguments of each command, as USAGE lists them (the commands read nothing else). */
export const COMMANDS: Readonly<Record<string, CommandSpec>> = {
  info: { values: [], switches: ['json'], positional: 'one', positionalName: 'FILE' },
  generate: {
    values: [
      'model',
      'prompt',
      'kv',
      'max-tokens',
      'temperature',
      'top-k',
      'top-p',
      'min-p',
      'repetition-penalty',
      'seed',
    ],
    switches: ['chat', 'json'],
    positional: 'none',
  },
  eval: {
    values: [
      'model',
      'text',
      'ctx',
      'kv',
      'max-windows',
      'prefill-matmul',
      'prefill-attention',
      'chunk',
      'kv-budget',
      'sink',
      'window',
      'group-size',
      'task',
      'lengths',
      'depths',
      'distances',
      'trials',
      'seed',
      'digits',
      'pairs',
      'queries',
      'value-digits',
      'copy-tokens',
    ],
    switches: ['compare', 'json', 'quiet'],
    positional: 'many',
  },
  capacity: { values: ['model', 'kv-budget', 'kv', 'decode-steps'], switches: ['json'], positional: 'none' },
  calibrate: {
    values: ['model', 'out', 'embed', 'text', 'tokens', 'seed'],
    switches: ['plan-only'],
    positional: 'none',
  },
  fidelity: {
    values: ['model', 'text', 'ctx', 'windows', 'modes', 'sink', 'window', 'group-size', 'chunk'],
    switches: ['json'],
    positional: 'many',
  },
};

/** USAGE's entries for `command` (a command may have several forms), or the whole text for none or an unknown one. */
export function usageOf(command: string | undefined): string {
  if (command === undefined || !Object.hasOwn(COMMANDS, command)) return USAGE;
  const [title, ...entries] = USAGE.split(/\n(?= {2}longtab )/);
  const own = entries.filter((e) => e.startsWith(`  longtab ${command} `) || e.startsWith(`  longtab ${command}\n`));
  return `${title.trimEnd()}\n\n${own.map((e) => e.trimEnd()).join('\n')}\n`;
}

export async function runCli(argv: string[]): Promise<number> {
  try {
    const args = parseArgs(argv, COMMANDS);
    switch (args.command) {
      case 'info':
        return await runInfo(args);
      case 'generate':
        return await withGpu(args, runGenerate);
      case 'eval':
        return await withGpu(args, runEval);
      case 'calibrate':
        return await withGpu(args, runCalibrate);
      case 'capacity':
        return await withGpu(args, runCapacity);
      case 'fidelity':
        return await withGpu(args, runFidelity);
      case 'help':
      case '--help':
      case '-h':
        process.stdout.write(usageOf(args.positional[0]));
        return 0;
      default:
        process.stderr.write(`longtab: unknown command '${args.command}'\n\n${USAGE}`);
        return 2;
    }
  } catch (error) {
    if (error instanceof LongtabError) {
      process.stderr.write(`longtab: ${error.name}: ${error.message}\n`);
      return 1;
    }
    throw error;
  } finally {
    releaseNodeGpu();
  }
}

async function withGpu(
  args: ParsedArgs,
  run: (args: ParsedArgs, gpu: Awaited<ReturnType<typeof acquireGpu>>) => Promise<number>,
): Promise<number> {
  const gpu = await acquireGpu({ gpu: await nodeGpu() });
  try {
    return await run(args, gpu);
  } finally {
    gpu.destroy();
  }
}

export { numberFlag, stringFlag };
