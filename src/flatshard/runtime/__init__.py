"""The engine: units, their flat groups, collectives, hooks, construction. Imports nothing above it
(no front end, no state dicts, no checkpoints); tests/test_layering.py holds it to that.

The words (DESIGN.md)
---------------------
  unit         one wrapped module, one ``fully_shard`` call: the atom of scheduling. Hooks and the run
               context speak to units (unit.py: ``Unit``).
  flat group   what a unit's parameters are stored and communicated as: one flat buffer with its layout,
               dtype, process groups, gather and reduction (flat_group.py: ``FlatGroup``). The atom of
               communication: one all-gather per group per pass, one reduce-scatter per group per
               backward, never one collective per parameter. A unit holds one per (mesh, dtype, layout
               kind) -- usually exactly one; frozen parameters of another dtype in a ``fully_shard``
               call add one per dtype ([Note: a flat group per dtype], build/grouping.py), parameters placed
               on a mesh of their own one per (mesh, dtype) ([Note: a flat group per mesh]); whole-tensor
               placement would add a group too, not a new kind of unit.
  run context  what spans the units of one root: phase, recorded order, prefetch, reductions in flight
               (schedule.py: ``RunContext``); a unit and its parts see it through context.py's ``Context``
               protocol and ``Link``, never by importing schedule.py.

Where things live
-----------------
  the step     hooks.py (every hook, in step order) -> schedule.py (RunContext) -> unit.py (Unit: fans out)
               -> flat_group.py (FlatGroup) -> its parts: gather.py (Gather: the unsharded flat and its
               all-gather), grad_state.py (GradState, WindowMarks: grad shard, open window), reduce.py
               (the reduction's three steps), layout.py / chunked.py (layouts and views),
               precision.py, post_forward.py, across_replicas.py (pieces over the replicas)
  leaves       consistency.py (Phase, order checks, errors naming the unit), context.py (Context, Link,
               UnitSettings), instrument.py (recorders, profiler labels)
  comm/        bytes between ranks: collectives, gloo exchange, mesh, streams, agree, nodes, int8;
               knows tensors and groups, never units
  build/       construction, once per wrap: units.py (build_units, build_unit, become_root), placement,
               deferred init, auto-F, fingerprints, optimizer checks; imported by the front ends only
  between      tree.py (hosts, names, ``flatshard.units``), summon.py, grad_utils.py (clip_grad_norm_,
  steps        no_sync), recording.py (recorders on a root)

One step of one unit (FULL_SHARD), each step as file:function
-------------------------------------------------------------
Construction (once)
  build/units.py:build_units    ignored states, devices, wrap policy (wrap.py:select_units), placement
                                (build/placement.py:Placement), sharding factor (build/autoshard.py),
                                groups (comm/mesh.py)
  build/units.py:build_unit     flatten (layout.py:FlatLayout.flatten); flat_group.py:FlatGroup keeps the
                                flat shard (fully_shard: one per (mesh, dtype), build/grouping.py:mesh_groups,
                                dtype_groups);
                                unit.py:Unit holds the groups; a RunContext of its own
  hooks.py:register_post_backward   each group's unsharded flat's post-accumulate-grad hook
  build/units.py:become_root    one run context (schedule.py:RunContext) for every unit under the root
Forward
  hooks.py:forward              the front end's forward: hooks.py:_begin_forward casts the inputs and
                                begins the pass (root); fully_shard: the same steps as module hooks
                                (forward_pre_hook / forward_post_hook)
  hooks.py:pre_forward          Unit.unshard -> FlatGroup.unshard -> gather.py:Gather.unshard ->
                                comm/collectives.py:all_gather (comm/gloo_exchange.py on CPU; on the
                                gather stream, comm/streams.py), Gather.consume;
                                Unit.use_compute_views -> FlatGroup.use_compute_views (layout.py);
                                RunContext.record_forward, RunContext.prefetch_forward
  hooks.py:post_forward         Unit.use_shard_views; Unit.reshard unless the root (or SHARD_GRAD_OP)
  hooks.py:register_pre_backward  a tensor hook on every output; RunContext.end_forward (root)
Backward
  hooks.py:pre_backward         hooks.py:begin_backward (queues end_of_backward once); Unit.unshard;
                                RunContext.prefetch_backward (BACKWARD_PRE)
  hooks.py:_on_split_backward   FlatGroup.reshard before the group's flat gradient is joined
  hooks.py:post_backward        per flat group: RunContext.settle_reductions; FlatGroup.start_reduction ->
                                reduce.py:start -> comm/collectives.py:reduce_scatter; FlatGroup.reshard;
                                RunContext.settle -> FlatGroup.finish_reduction -> reduce.py:finish
                                (all-reduce across replicas, divide) -> grad_state.py:GradState.expose;
                                across nodes FlatGroup.advance_reduction -> reduce.py:advance leaves the
                                all-reduce in flight (comm/int8.py)
  hooks.py:end_of_backward      RunContext.end_of_backward: reductions in flight, Unit.end_backward
                                (parameters that gather themselves reduce; reshard; mark an open window)
Between steps
  the optimizer steps the shard views locally; grad_utils.py:clip_grad_norm_ (one all-reduce),
  grad_utils.py:no_sync; summon.py:summon (FlatGroup.gather_owned); comm/agree.py (every rank ends alike)

Index of every [Note: ...] in the package
-----------------------------------------
  flatshard tensors ............... runtime/layout.py
  shard boundaries ................ runtime/layout.py
  chunked layout .................. runtime/chunked.py
  sharded along another dim ....... runtime/chunked.py
  reshard after forward to a smaller group .. runtime/post_forward.py
  precision of a unit's tensors ... runtime/precision.py
  reductions in flight ............ runtime/schedule.py
  outside function transforms ..... runtime/unit.py
  custom collectives .............. runtime/reduce.py
  prefetch ........................ runtime/schedule.py
  stream discipline ............... runtime/comm/streams.py
  a step that raised .............. runtime/schedule.py
  a forward with no backward after it .. runtime/schedule.py
  an open accumulation window .... runtime/grad_state.py
  exchange tags ................... runtime/comm/gloo_exchange.py
  inter-node compression .......... runtime/comm/int8.py
  gloo's workers at exit .......... runtime/comm/mesh.py
  optimizer state across replicas .. runtime/across_replicas.py
  pieces in the chunked layout .... runtime/across_replicas.py
  forward inside summon_full_params .. runtime/summon.py
  recomputation in backward ....... runtime/hooks.py
  free before the flat gradient ... runtime/hooks.py
  hooks hold units weakly ......... runtime/hooks.py
  hooks under compile ............. runtime/hooks.py
  unused parameters in a reduction .. runtime/hooks.py
  a flat group per dtype .......... runtime/build/grouping.py
  a flat group per mesh ........... runtime/build/grouping.py
  deferred initialisation ......... runtime/build/deferred.py
  meta parameters left to the user . runtime/build/deferred.py
  equal errors .................... runtime/comm/agree.py
  model fingerprint ............... runtime/build/fingerprint.py
  order checks .................... runtime/consistency.py
  order checks of units on several meshes .. runtime/consistency.py
  optimizers on shard views ....... runtime/build/optim_check.py
  bounded recorders ............... runtime/instrument.py
  nested wrappers ................. fsdp.py
  get_state_dict on the wrapper ... fsdp.py
  a group of modules .............. fsdp2/frontend.py
  optimizer state across replicas on fully_shard .. fsdp2/frontend.py
  FSDP over tensor-parallel parameters .. fsdp2/tensor_parallel.py
  parameters on the whole SPMD mesh .. fsdp2/spmd.py
  parameters that gather themselves .... fsdp2/extensions.py
  whole parameters on fully_shard .... fsdp2/whole.py
  composing with torch's replicate .. fsdp2/checks.py
  flat ranges as boxes ............ state/sharded_tensors.py
  loading through a plain parent .. state/module.py
  crash-safe commit ............... checkpoint/directory.py
  latest and rotation ............. checkpoint/directory.py
  checksums ....................... checkpoint/format.py
  fully_shard checkpoints are DCP safetensors .. checkpoint/dtensors.py
  a fully_shard checkpoint waits as long as the model does .. checkpoint/dtensors.py
  asynchronous saves of fully_shard models .. checkpoint/dtensors.py
  bf16-mixed accounting ........... planner/inputs.py
  planner memory model ............ planner/memory.py
  planner communication model ..... planner/comm.py
  planner step schedule ........... planner/steptime.py
  planner CPU offload model ....... planner/offload.py
  planner units ................... planner/quantities.py
  planner private strategy margin . planner/plan.py
  a flag for the other schedule ... planner/plan.py
"""
