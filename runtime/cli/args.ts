import { parseArgs as parseNodeArgs } from 'node:util';
import { InvalidRequestError } from '../../core/errors.ts';

export interface ParsedArgs {
  command: string;
  positional: string[];
  flags: Map<string, string | true>;
}

/** What a command accepts: flags that take a value, switches that take none, and its positional arguments. */
export interface CommandSpec {
  values: readonly string[];
  switches: readonly string[];
  /** None, exactly one (e.g. a FILE), or any number (more text files). */
  positional: 'none' | 'one' | 'many';
  /** The positional argument's name in messages, e.g. 'FILE'. */
  positionalName?: string;
}

/**
 * `cmd a b --flag value --flag=value --switch`, strictly against the command's spec (node:util's parser): an unknown
 * flag, a flag without its value, a switch given one, or a stray positional argument is an InvalidRequestError that
 * lists what the command takes, so a typo such as `--max_tokens 3` never runs with the default instead. A command
 * without a spec (help, an unknown command) keeps its words as positional arguments; `CMD --help` (or `-h`) is
 * `help CMD`.
 */
export function parseArgs(argv: string[], specs: Readonly<Record<string, CommandSpec>>): ParsedArgs {
  const [command = 'help', ...rest] = argv;
  const spec = Object.hasOwn(specs, command) ? specs[command] : undefined;
  if (!spec) return { command, positional: rest, flags: new Map() };
  // `longtab eval --help`: the command's own usage, whatever else the line holds.
  if (rest.includes('--help') || rest.includes('-h'))
    return { command: 'help', positional: [command], flags: new Map() };
  const takes = [...spec.values.map((f) => `--${f} VALUE`), ...spec.switches.map((f) => `--${f}`)];
  const known = takes.length > 0 ? `'${command}' takes ${takes.join(', ')}.` : `'${command}' takes no flags.`;
  let parsed: ReturnType<typeof parseNodeArgs>;
  try {
    parsed = parseNodeArgs({
      args: rest,
      strict: true,
      allowPositionals: true,
      options: Object.fromEntries([
        ...spec.values.map((f) => [f, { type: 'string' as const }]),
        ...spec.switches.map((f) => [f, { type: 'boolean' as const }]),
      ]),
    });
  } catch (error) {
    // node:util's message names the flag ("Unknown option '--max_tokens'", "Option '--ctx <value>' argument missing").
    const first = (error instanceof Error ? error.message : String(error)).split('\n')[0];
    const message = first.split('. ')[0].replace(/\.$/, '');
    throw new InvalidRequestError(`${message}. ${known}`);
  }
  const positional = parsed.positionals;
  const allowed = spec.positional === 'none' ? 0 : spec.positional === 'one' ? 1 : Number.POSITIVE_INFINITY;
  if (positional.length > allowed) {
    const stray = positional.slice(allowed).map((s) => `'${s}'`);
    const rule =
      allowed === 0 ? `'${command}' takes no positional arguments` : `'${command}' takes one ${spec.positionalName}`;
    throw new InvalidRequestError(`Unexpected argument ${stray.join(', ')}: ${rule}. ${known}`);
  }
  const flags = new Map<string, string | true>();
  for (const [name, value] of Object.entries(parsed.values)) {
    if (value === true || typeof value === 'string') flags.set(name, value);
  }
  return { command, positional, flags };
}

export function stringFlag(args: ParsedArgs, name: string): string | undefined {
  const v = args.flags.get(name);
  if (v === true) throw new InvalidRequestError(`--${name} needs a value.`);
  return v;
}

export function numberFlag(args: ParsedArgs, name: string, fallback: number): number {
  const v = stringFlag(args, name);
  if (v === undefined) return fallback;
  const n = Number(v);
  if (!Number.isFinite(n)) throw new InvalidRequestError(`--${name} must be a number, got '${v}'.`);
  return n;
}
