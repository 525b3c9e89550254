// Imported first by cli.ts, before the rest of the program allocates. Busy allocation makes V8
// grow its young generation up to semi-spaces sized from the machine's memory, and keep it.
// With a growth factor of 1 the young generation stays at its initial size: less resident
// memory at rest and per call in flight, for a little more of the CPU spent collecting garbage
// (BENCHMARKS.md, "What limits the rest", has both sides measured). Unlike
// --max-semi-space-size, which V8 reads only when it starts, this flag is read each time the
// young generation could grow, so it works from here. A young-generation flag on the command
// line or in NODE_OPTIONS wins.
import v8 from 'node:v8';

const YOUNG_GENERATION_FLAG = /^--(max|min)[-_]semi[-_]space[-_]size|^--semi[-_]space[-_]growth[-_]factor/;
const given = [...process.execArgv, ...(process.env.NODE_OPTIONS ?? '').split(/\s+/)];
if (!given.some((flag) => YOUNG_GENERATION_FLAG.test(flag))) v8.setFlagsFromString('--semi-space-growth-factor=1');
