#!/usr/bin/env node
// The longtab CLI runs the TypeScript sources directly through tsx, so the CLI and the browser share one engine.
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { register } from 'tsx/esm/api';

register();
const main = join(dirname(fileURLToPath(import.meta.url)), '..', 'runtime', 'cli', 'main.ts');
const { runCli } = await import(main);
process.exitCode = await runCli(process.argv.slice(2));
