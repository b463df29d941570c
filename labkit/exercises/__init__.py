"""The course's exercises in one place: the graders of the "your turn" cells, the review quiz and the stack map.

    allreduce   check_naive_allreduce, check_ring_allreduce (notebooks 02 and 03): the student's AllReduce on
                2, 3 and 4 real ranks, against torch's answer and the algorithm's traffic (its rank side, the
                guard that switches collectives off and counts messages, in the same file; rank_input)
    average     check_average_gradients (notebook 01): the student's gradient average after backward() on 2, 3
                and 4 real ranks, against one process trained on the whole batch (its rank side in the same file)
    ddp_hook    check_bucketed_ddp_hook (notebook 04): the student's bucketed DDP from post-accumulate-grad hooks,
                against torch's DDP, communication started inside backward (its rank side in the same file)
    megatron    check_megatron_f_g (notebook 05): the student's f and g autograd functions in Megatron's MLP on
                two drawn world sizes and dtypes, against one process, one all_reduce each way (one file, on the kit)
    accumulation  check_no_sync_accumulation (notebook 07): accumulation with DDP's no_sync(), one AllReduce per
                  optimizer step, equal to the large batch (one file, on the kit)
    atomic_save check_atomic_save (notebook 09): the student's checkpoint save killed midway, the previous one
                must survive (its rank side in the same file, watched by the kit's _file_watch)
    bug_zoo     notebook 15's six broken training runs (zoo_run), their symptoms and causes (the widget is
                labkit.widgets.zoo_diagnosis); bug_zoo_fix: check_fixed_training, the student's repair of one
    mesh_coordinates  check_mesh_coordinates (notebook 13): a rank's (dp, pp, tp) coordinates and its three
                      groups, against torch's DeviceMesh layout, no processes
    diagnosis   what is wrong with a wrong AllReduce: its values, its traffic (`ring_nbytes_per_rank`)
    token_dispatch  check_expert_dispatch (notebook 18): the student's dispatch and combine of expert parallelism
                    (all_to_all_single, split sizes exchanged first) on 2, 3 and 4 real ranks, against one process's
                    mixture-of-experts layer with the same capacity rule (one file, on the kit)
    verdict     Verdict, the grade every grader returns
    ring_step   check_ring_step (notebook 17): the student's step of ring attention (a block's attention merged
                into the running one by the log-sum-exp rule), on drawn blocks, then as ring attention's step on
                2, 3 and 4 real ranks against one process (one file, on the kit)
    schedule_order  check_1f1b_order (notebook 06): the student's 1F1B action order for stage r of p with m
                    micro-batches, against labkit.parallel.pipeline's schedule for many (p, m, r), no processes
    progress    graded() records every grader's verdict in the student's progress file; show_progress() lists it
    quiz        the review's questions and flashcards (notebooks 06 and 10), from quiz.json beside it
    stack_map   STACK_MAP and check_stack_map (notebook 10)
    sharded_step  check_sharded_step (notebook 11): the student's ZeRO-1 step (reduce-scatter, update one slice,
                  all-gather) on 2, 3 and 4 real ranks, against full SGD in one process and ZeRO's traffic; its
                  rank side (step_inputs: each rank's param and grad) in the same file, on the kit, and what is
                  wrong with a wrong step's values and traffic in the private _step_diagnosis

`where_ranks_waited(hang)` says where the ranks of a RankTimeout waited, outside the graders (notebook 15).

The widgets that show the quiz, the flashcards and the stack map are in `labkit.widgets`.
"""

from labkit._refusals import ForbiddenCall
from labkit.exercises._kit._messages import where_ranks_waited
from labkit.exercises.accumulation import check_no_sync_accumulation
from labkit.exercises.allreduce import TIMEOUT_SECONDS, check_naive_allreduce, check_ring_allreduce, rank_input
from labkit.exercises.atomic_save import check_atomic_save
from labkit.exercises.average import check_average_gradients
from labkit.exercises.bug_zoo_fix import check_fixed_training
from labkit.exercises.ddp_hook import check_bucketed_ddp_hook
from labkit.exercises.diagnosis import ring_nbytes_per_rank
from labkit.exercises.megatron import check_megatron_f_g
from labkit.exercises.mesh_coordinates import check_mesh_coordinates
from labkit.exercises.progress import show_progress
from labkit.exercises.quiz import (
    Feedback,
    Flashcard,
    Option,
    Question,
    load_distractor_families,
    load_flashcards,
    load_questions,
)
from labkit.exercises.ring_step import check_ring_step
from labkit.exercises.schedule_order import check_1f1b_order
from labkit.exercises.sharded_step import check_sharded_step, step_inputs
from labkit.exercises.stack_map import STACK_MAP, check_stack_map
from labkit.exercises.token_dispatch import check_expert_dispatch
from labkit.exercises.verdict import Verdict

__all__ = ["STACK_MAP", "TIMEOUT_SECONDS", "Feedback", "Flashcard", "ForbiddenCall", "Option", "Question", "Verdict",
           "check_1f1b_order", "check_atomic_save", "check_average_gradients", "check_bucketed_ddp_hook",
           "check_expert_dispatch",
           "check_fixed_training", "check_megatron_f_g", "check_mesh_coordinates", "check_naive_allreduce",
           "check_no_sync_accumulation", "check_ring_allreduce", "check_ring_step", "check_sharded_step",
           "check_stack_map",
           "load_distractor_families", "load_flashcards", "load_questions", "rank_input", "ring_nbytes_per_rank",
           "show_progress", "step_inputs", "where_ranks_waited"]
