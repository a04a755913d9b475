"""Offline batch work over OpenAI batch files: `qiao batch run`.

- `lines`: the input file's lines (`custom_id`, `method`, `url`, `body`) and the output and error
  files' lines, in OpenAI's formats.
- `state`: a job's durable state in SQLite (the finished lines), so a killed run resumes.
- `offline`: runs a job's lines on an in-process engine (and encoder) at offline speed.
- `cli`: the `qiao batch` command.

`lines` and `state` import no other qiao layer (the server's Batch API builds on them); `offline`
and `cli` sit above the API layer, whose request parsing and response assembly they reuse.
"""
