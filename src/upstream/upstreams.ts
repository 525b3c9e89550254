// The upstreams a live request can go to: the UPSTREAMS_FILE format, its checks, and a model's
// deployments: every upstream that serves it, preferred in the file's order. The file is read
// once at start-up, so a bad one stops the process with one message naming every problem.
import { readFileSync } from 'node:fs';
import * as v from 'valibot';
import { parse as parseYaml, parseDocument as parseYamlDocument, YAMLParseError } from 'yaml';

export interface LaneLimits {
  /** Calls in flight at once. */
  readonly maxConcurrent: number | undefined;
  readonly requestsPerMinute: number | undefined;
  /** Tokens per minute: a call's prompt tokens are estimated before it, then corrected with its answer's usage. */
  readonly tokensPerMinute: number | undefined;
}

export interface Upstream {
  readonly name: string;
  /** Without trailing slashes: the calls go to `${baseUrl}/chat/completions`. */
  readonly baseUrl: string;
  readonly apiKey: string | undefined;
  /** Exact model names and `prefix*` patterns, as clients request them; `*` alone serves every model. */
  readonly models: readonly string[];
  /** The upstream's own name for a model that it serves under another (public name to its own). */
  readonly renames: Readonly<Record<string, string>>;
  readonly limits: LaneLimits;
}

/** Limits that hold nothing back: the default upstream's, and the simulator's. */
export const NO_LIMITS: LaneLimits = Object.freeze({
  maxConcurrent: undefined,
  requestsPerMinute: undefined,
  tokensPerMinute: undefined,
});

/** Whether these limits hold nothing back, as NO_LIMITS. */
export function hasNoLimits(limits: LaneLimits): boolean {
  return limits.maxConcurrent === undefined && limits.requestsPerMinute === undefined && limits.tokensPerMinute === undefined;
}

/** The name of the one upstream built from UPSTREAM_BASE_URL when UPSTREAMS_FILE is unset. */
export const DEFAULT_UPSTREAM = 'default';
/** The name test mode's simulator answers under; a file may not use it. */
export const SIMULATOR = 'simulator';

export class UpstreamsFileError extends Error {
  override name = 'UpstreamsFileError';
}

const MAX_LIMIT = 10_000_000;
const ENV_NAME = /^[A-Za-z_][A-Za-z0-9_]*$/;
// The gateway's own secrets (and SECRET_ENCRYPTION_KEY*): an upstream's key is sent to its
// base_url, so a file naming one of these would hand it to whoever answers there.
const GATEWAY_VARIABLES = ['DATABASE_URL', 'METRICS_TOKEN', 'GATEWAY_SIGNING_SECRET', 'GATEWAY_API_KEY'];

/** Whether the variable is one of the gateway's own (in any case: some systems' variables ignore it). */
function isGatewayVariable(name: string): boolean {
  const upper = name.toUpperCase();
  return upper.startsWith('SECRET_ENCRYPTION_KEY') || GATEWAY_VARIABLES.includes(upper);
}

/** A strict object, so a misspelt key is an error rather than a setting silently ignored. */
const settings = <const Entries extends v.ObjectEntries>(entries: Entries) =>
  v.pipe(
    // Without this, a list would be read as an object with keys 0, 1, ...
    v.custom<object>((input) => typeof input === 'object' && input !== null && !Array.isArray(input), 'must be an object'),
    v.strictObject(entries, (issue) =>
      issue.expected === 'never' ? `is not a known key (the keys are ${Object.keys(entries).join(', ')})` : 'is required',
    ),
  );

const limit = v.optional(
  v.pipe(
    v.number('must be a whole number of at least 1'),
    v.check((value) => Number.isSafeInteger(value) && value >= 1, 'must be a whole number of at least 1'),
    v.maxValue(MAX_LIMIT, `must be at most ${MAX_LIMIT}`),
  ),
);

const ModelName = v.pipe(
  v.string('must be a string'),
  v.minLength(1, 'must be 1 to 256 characters'),
  v.maxLength(256, 'must be 1 to 256 characters'),
);

const Model = v.pipe(ModelName, v.regex(/^[^*]*\*?$/, 'may hold "*" only as its last character (a prefix pattern)'));

/** `{"gpt-4o": "my-gpt-4o-deployment"}`: the model clients name, served under the upstream's own name. */
const RenamedModel = v.pipe(
  v.record(v.pipe(ModelName, v.regex(/^[^*]*$/, 'must be an exact model name to be renamed (no "*")')), ModelName),
  v.check((entry) => Object.keys(entry).length === 1, 'must map one model name to the upstream\'s own name for it'),
);

/** The file's schema; `env` is where the api_key_env variables must be set. */
function upstreamsFile(env: Record<string, string | undefined>) {
  const Upstream = settings({
    name: v.pipe(
      v.string('must be a string'),
      v.regex(
        /^[a-z0-9][a-z0-9_.-]{0,63}$/,
        'must be 1 to 64 characters of a-z, 0-9, "_", "." and "-", starting with a letter or digit',
      ),
      v.check((name) => name !== SIMULATOR, `"${SIMULATOR}" is reserved for test mode`),
    ),
    base_url: v.pipe(
      v.string('must be a string'),
      v.trim(),
      v.check(isHttpUrl, 'must be an http or https URL'),
      v.check((url) => !hasCredentials(url), 'may not hold a user name or password (an upstream\'s key goes in the variable api_key_env names)'),
      v.transform((url) => url.replace(/\/+$/, '')),
    ),
    api_key_env: v.optional(
      v.pipe(
        v.string('must be a string'),
        v.regex(ENV_NAME, 'must be the name of an environment variable (letters, digits and "_", not starting with a digit)'),
        v.check(
          (name) => !isGatewayVariable(name),
          (issue) =>
            `names ${String(issue.input)}, a variable of the gateway's own; an upstream's key must be in a variable of its own (it is sent to the upstream)`,
        ),
        // The message quotes neither the variable's value (a key) nor its name: a key written
        // here in place of a name is a name to the regex above when it is letters, digits and
        // "_" only, as many providers' keys are. The path names the line at fault.
        v.check(
          (name) => !ENV_NAME.test(name) || isGatewayVariable(name) || keyIn(env, name) !== undefined,
          'names an environment variable that is not set or empty',
        ),
      ),
    ),
    models: v.pipe(
      v.array(
        // An object is a rename; anything else must be a name (its messages say why not).
        v.lazy((input) => (typeof input === 'object' && input !== null && !Array.isArray(input) ? RenamedModel : Model)),
        'must be a list of model names',
      ),
      v.minLength(1, 'must list at least one model'),
    ),
    limits: v.optional(
      settings({
        max_concurrent: limit,
        requests_per_minute: limit,
        tokens_per_minute: limit,
      }),
    ),
  });
  return settings({
    upstreams: v.pipe(v.array(Upstream, 'must be a list of upstreams'), v.minLength(1, 'must list at least one upstream')),
  });
}

export function loadUpstreamsFile(path: string, env: Record<string, string | undefined>): Upstream[] {
  const fail = (problems: string) => new UpstreamsFileError(`Invalid upstreams file ${path}:${problems}`);

  let text: string;
  try {
    text = readFileSync(path, 'utf8').replace(/^\uFEFF/, '');
  } catch (error) {
    throw fail(` cannot be read (${(error as NodeJS.ErrnoException).code ?? (error as Error).message})`);
  }
  const yaml = /\.ya?ml$/i.test(path);
  let input: unknown;
  try {
    // logLevel 'error': the first error throws, and warnings are not printed to the console.
    input = yaml ? parseYaml(text, { logLevel: 'error' }) : JSON.parse(text);
  } catch (error) {
    throw fail(` not valid ${yaml ? 'YAML' : 'JSON'}: ${yaml ? describeYamlError(error) : describeJsonError(error, text)}`);
  }

  const parsed = v.safeParse(upstreamsFile(env), input);
  const problems = [
    ...(parsed.success ? [] : parsed.issues.map((issue) => `${pathOf(issue) || '(top level)'}: ${issue.message}`)),
    ...duplicateNames(input),
  ];
  if (!parsed.success || problems.length > 0) throw fail(`\n  ${problems.join('\n  ')}`);

  return Object.freeze(
    parsed.output.upstreams.map((upstream) =>
      Object.freeze({
        name: upstream.name,
        baseUrl: upstream.base_url,
        apiKey: upstream.api_key_env === undefined ? undefined : keyIn(env, upstream.api_key_env),
        models: Object.freeze(upstream.models.map((entry) => (typeof entry === 'string' ? entry : Object.keys(entry)[0]!))),
        renames: Object.freeze(Object.fromEntries(upstream.models.flatMap((entry) => (typeof entry === 'string' ? [] : Object.entries(entry))))),
        limits: Object.freeze({
          maxConcurrent: upstream.limits?.max_concurrent,
          requestsPerMinute: upstream.limits?.requests_per_minute,
          tokensPerMinute: upstream.limits?.tokens_per_minute,
        }),
      }),
    ),
  ) as Upstream[];
}

export function defaultUpstream(baseUrl: string, apiKey: string | undefined): Upstream {
  return Object.freeze({
    name: DEFAULT_UPSTREAM,
    baseUrl: baseUrl.replace(/\/+$/, ''),
    apiKey,
    models: Object.freeze(['*']),
    renames: Object.freeze({}),
    limits: NO_LIMITS,
  });
}

/** The model's deployments: the upstreams with a model name or prefix pattern that matches it, in the file's order. */
export function deploymentsOf(upstreams: readonly Upstream[], model: string): Upstream[] {
  return upstreams.filter((upstream) => matchingPattern(upstream, model) !== undefined);
}

/** The name the upstream knows the model by: its own, when the file renames it. */
export function upstreamModel(upstream: Upstream, model: string): string {
  return Object.hasOwn(upstream.renames, model) ? upstream.renames[model]! : model;
}

/**
 * A model as a metrics label: the model itself when the upstream names it, else the pattern
 * that matched it, so that labels are bounded by the configuration, not by what clients send.
 */
export function modelLabel(upstream: Upstream, model: string): string {
  return matchingPattern(upstream, model) ?? model;
}

/** The upstream's entry that serves the model: its exact name first, else the first prefix pattern that matches. */
function matchingPattern(upstream: Upstream, model: string): string | undefined {
  if (upstream.models.includes(model)) return model;
  return upstream.models.find((pattern) => pattern.endsWith('*') && model.startsWith(pattern.slice(0, -1)));
}

/**
 * Whether the URL holds a user name or password. Calls are made with undici, which sends none of
 * them: they would reach no upstream, only what shows the URL (gateway upstreams).
 */
export function hasCredentials(value: string): boolean {
  const url = URL.parse(value);
  return url !== null && (url.username !== '' || url.password !== '');
}

function isHttpUrl(value: string): boolean {
  const url = URL.parse(value);
  return url !== null && (url.protocol === 'http:' || url.protocol === 'https:');
}

/** The key an upstream's api_key_env names, or undefined when it is unset or blank. */
function keyIn(env: Record<string, string | undefined>, name: string): string | undefined {
  const key = env[name]?.trim();
  return key ? key : undefined;
}

/** Names seen more than once, each reported where it repeats; run on the raw input so that it
 *  is reported alongside every other problem, not only once the rest of the file is right. */
function duplicateNames(input: unknown): string[] {
  const upstreams = (input as { upstreams?: unknown } | null)?.upstreams;
  if (!Array.isArray(upstreams)) return [];
  const firstIndex = new Map<string, number>();
  const problems: string[] = [];
  upstreams.forEach((upstream: unknown, index) => {
    const name = (upstream as { name?: unknown } | null)?.name;
    if (typeof name !== 'string') return;
    const first = firstIndex.get(name);
    if (first === undefined) firstIndex.set(name, index);
    else problems.push(`upstreams[${index}].name: "${name}" is already the name of upstreams[${first}]`);
  });
  return problems;
}

/** upstreams[1].limits.requests_per_minute */
function pathOf(issue: v.BaseIssue<unknown>): string {
  let path = '';
  for (const item of issue.path ?? []) {
    path += typeof item.key === 'number' ? `[${item.key}]` : `${path ? '.' : ''}${String(item.key)}`;
  }
  return path;
}

// The parsers' messages quote the text around the fault; the file is ours to keep out of logs,
// so a message keeps the parser's words and position and drops the quoted text.
function describeYamlError(error: unknown): string {
  if (!(error instanceof YAMLParseError)) return (error as Error).message;
  const [start] = error.linePos ?? [];
  const words = error.message.split(' at line ')[0]!;
  return start ? `${words} at line ${start.line}, column ${start.col}` : words;
}

function describeJsonError(error: unknown, text: string): string {
  const message = (error as Error).message;
  const withPosition = /^(.*) in JSON at position \d+ \(line (\d+) column (\d+)\)$/.exec(message);
  if (withPosition) return `${withPosition[1]} at line ${withPosition[2]}, column ${withPosition[3]}`;
  // "Unexpected token 'x', "<the text>" is not valid JSON" comes without a position; the YAML
  // parser, reading the text as JSON, finds where the bad token starts.
  const words = message.replace(/, (\.\.\.)?".*$/s, '');
  const [start] = parseYamlDocument(text, { schema: 'json' }).errors[0]?.linePos ?? [];
  return start ? `${words} at line ${start.line}, column ${start.col}` : words;
}
