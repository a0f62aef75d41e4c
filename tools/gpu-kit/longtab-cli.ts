/**
 * The longtab CLI as one bundled entry for the GPU host (`npm run bench:bundle` writes .gpu/longtab.mjs): the host has
 * no tsx, so bin/longtab.mjs cannot run there. Same commands, same engine: `/tmp/kit/run.sh .gpu/longtab.mjs eval ...`.
 */
import { runCli } from '../../runtime/cli/main.ts';

process.exitCode = await runCli(process.argv.slice(2));
