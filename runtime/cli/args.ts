import { InvalidRequestError } from '../../core/errors.ts';

export interface ParsedArgs {
  command: string;
  positional: string[];
  flags: Map<string, string | true>;
}

/** `cmd a b --flag value --switch`: flags take the next word as value unless it starts with `--`. */
export function parseArgs(argv: string[]): ParsedArgs {
  const [command = 'help', ...rest] = argv;
  const positional: string[] = [];
  const flags = new Map<string, string | true>();
  for (let i = 0; i < rest.length; i++) {
    const word = rest[i];
    if (!word.startsWith('--')) {
      positional.push(word);
      continue;
    }
    const eq = word.indexOf('=');
    if (eq > 0) {
      flags.set(word.slice(2, eq), word.slice(eq + 1));
    } else if (i + 1 < rest.length && !rest[i + 1].startsWith('--')) {
      flags.set(word.slice(2), rest[++i]);
    } else {
      flags.set(word.slice(2), true);
    }
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
